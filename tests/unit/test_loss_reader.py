"""The loss read once per optimizer step, as on an accelerator, exercised on the CPU.

On CUDA the loop keeps each micro-batch's loss on the device and reads the window once,
in the step's pre-hook (torchgpu.train.loop.loss_reader). Here the device is the CPU, so the
choice is forced (the ``per_step`` fixture); the syncs are counted through a
TorchFunctionMode that sees every Tensor-to-host read (``item``, ``tolist``,
``float()``, ``bool()``, ``.cpu()``...). The GPU kit checks the same on CUDA with
``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import collections
import math
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tests.user_models import TokenDataset, lm_factory
from torchgpu import fit
from torchgpu.bench.suites.train_step import loop_parts
from torchgpu.errors import NonFiniteLossError
from torchgpu.train.loop import epoch as loop
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.state import TrainState

SYNCS = {"item", "tolist", "__float__", "__bool__", "__int__", "__index__", "cpu", "numpy"}


class SyncCounter(TorchFunctionMode):
    """Counts host reads of tensor values, by call site. Torch's own optimizers are left
    out: their step counters live on the host by design (non-capturable Adam), or on the
    device and are never read (fused Adam, the CUDA choice), so no device sync is there."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in SYNCS:
            caller = traceback.extract_stack(limit=2)[0]
            if "/torch/optim/" not in caller.filename:
                self.sites[f"{name} {Path(caller.filename).name}:{caller.lineno}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.sites.values())


@pytest.fixture
def per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the loop chooses on an accelerator, here on the CPU."""
    monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)


def _data(samples: int = 100, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(samples, 13, generator=g), torch.randn(samples, 1, generator=g)
    return list(zip(x.split(8), y.split(8), strict=True))


def _train(accumulate: int, *, precision: str = "fp32", loss_fn: Any = None,
           on_nonfinite: str = "stop", count: bool = False,
           seen: list[list[torch.Tensor]] | None = None) -> tuple[nn.Module, TrainState, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    batches = _data()
    parts = loop_parts(model, torch.device("cpu"), batch_size=8, lr=1e-2,
                       accumulate=accumulate, precision=precision, loss_fn=loss_fn,
                       on_nonfinite=on_nonfinite, samples=100)
    state = TrainState()

    def on_step(_: TrainState) -> None:
        if seen is not None:
            seen.append([p.detach().clone() for p in model.parameters()])

    counter = SyncCounter()
    with counter if count else _nothing():
        run_epoch(parts, batches, state, batches_per_epoch=len(batches), on_step=on_step)
    return model, state, counter.total


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _weights(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("accumulate", [1, 3])
def test_one_host_read_per_optimizer_step(per_step: None, accumulate: int) -> None:
    _, state, syncs = _train(accumulate, count=True)
    assert state.step == -(-13 // accumulate)  # 13 micro-batches (the last one short)
    assert syncs == state.step


def test_the_counter_sees_a_read_per_micro_batch_where_the_loop_reads_them() -> None:
    _, state, syncs = _train(3, count=True)  # the CPU's choice: one read per micro-batch
    assert state.batch_in_epoch == 13 and syncs >= 13


@pytest.mark.parametrize(("accumulate", "precision"), [(1, "fp32"), (3, "fp32"), (3, "bf16")])
def test_reading_per_step_trains_exactly_as_reading_per_micro_batch(
        monkeypatch: pytest.MonkeyPatch, accumulate: int, precision: str) -> None:
    model_a, state_a, _ = _train(accumulate, precision=precision)
    monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)
    model_b, state_b, _ = _train(accumulate, precision=precision)
    assert state_b.step_losses == state_a.step_losses
    assert state_b.epoch_loss_sum == state_a.epoch_loss_sum
    assert state_b.epoch_loss_count == state_a.epoch_loss_count
    for a, b in zip(_weights(model_a), _weights(model_b), strict=True):
        assert torch.equal(a, b)


class NanAt:
    """MSE, NaN on the ``at``-th call (1-based)."""

    def __init__(self, at: int) -> None:
        self.calls, self.at = 0, at

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = nn.functional.mse_loss(out, y)
        return loss * math.nan if self.calls == self.at else loss


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_nan_loss_stops_before_the_weights_see_it(per_step: None, accumulate: int) -> None:
    seen: list[list[torch.Tensor]] = []
    with pytest.raises(NonFiniteLossError, match=r"loss nan on rank 0 at step 3 "):
        _train(accumulate, loss_fn=NanAt(2 * accumulate + 1), seen=seen)
    assert len(seen) == 2  # two steps applied, the third refused
    # The same run reading per micro-batch stops at the same step with the same weights.
    reference: list[list[torch.Tensor]] = []
    loop_choice = loop.per_step_optimizer
    try:
        loop.per_step_optimizer = lambda device, acc: None  # type: ignore[assignment]
        with pytest.raises(NonFiniteLossError, match=r"at step 3 "):
            _train(accumulate, loss_fn=NanAt(2 * accumulate + 1), seen=reference)
    finally:
        loop.per_step_optimizer = loop_choice  # type: ignore[assignment]
    for a, b in zip(seen[-1], reference[-1], strict=True):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


def test_a_nan_loss_is_skipped_as_when_read_per_micro_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model_a, state_a, _ = _train(1, loss_fn=NanAt(4), on_nonfinite="skip")
    monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)
    model_b, state_b, _ = _train(1, loss_fn=NanAt(4), on_nonfinite="skip")
    assert state_b.skipped_steps == state_a.skipped_steps == 1
    assert state_b.step_losses == state_a.step_losses
    for a, b in zip(_weights(model_a), _weights(model_b), strict=True):
        assert torch.equal(a, b)


def test_a_skipped_window_leaves_finite_weights_and_is_counted_once(per_step: None) -> None:
    model, state, _ = _train(2, loss_fn=NanAt(3), on_nonfinite="skip")  # window 2's first
    assert state.skipped_steps == 1 and state.step == 6
    assert all(math.isfinite(v) for v in state.step_losses)
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_fit_reading_per_step_gives_the_run_it_gives_reading_per_micro_batch(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def run(name: str) -> Any:
        return fit(lm_factory, TokenDataset(48), epochs=2, batch_size=8, accumulate=2,
                     out=tmp_path / name, progress="off", log_every=1)

    a = run("a")
    monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)
    b = run("b")
    assert (tmp_path / "b" / "metrics.jsonl").read_text() != ""
    assert a.summary["final"]["train_loss"] == b.summary["final"]["train_loss"]
    for key, value in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[key], value), key
