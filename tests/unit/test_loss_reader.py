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
           seen: list[list[torch.Tensor]] | None = None,
           settle: Any = None, stop: Any = None,
           events: list[tuple[str, int]] | None = None) -> tuple[nn.Module, TrainState, int]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
    batches = _data()
    parts = loop_parts(model, torch.device("cpu"), batch_size=8, lr=1e-2,
                       accumulate=accumulate, precision=precision, loss_fn=loss_fn,
                       on_nonfinite=on_nonfinite, samples=100)
    state = TrainState()

    def on_step(done: TrainState) -> None:
        if seen is not None:
            seen.append([p.detach().clone() for p in model.parameters()])
        if events is not None:
            events.append(("step", done.step))

    if events is not None:
        model.register_forward_hook(lambda *_: events.append(("forward", len(events))))
    counter = SyncCounter()
    with counter if count else _nothing():
        run_epoch(parts, batches, state, batches_per_epoch=len(batches), on_step=on_step,
                  settle=settle, stop=stop)
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


# -- late reads: one step late, no sync, the step skipped on the device's word ----------


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's fused Adam (CUDA's choice; it runs on the CPU too): its step takes the
    device-side skip flag late reads need."""
    from torchgpu.train.recipe import optimizers

    monkeypatch.setattr(optimizers, "kernel_options", lambda params: {"fused": True})


def _never(step: int) -> bool:
    return False


def _forwards_before_steps(events: list[tuple[str, int]]) -> list[int]:
    """For each step's on_step, how many forwards had run by then."""
    found, forwards = [], 0
    for kind, _ in events:
        if kind == "forward":
            forwards += 1
        else:
            found.append(forwards)
    return found


def test_late_reads_train_exactly_as_reading_per_micro_batch(
        fused: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen_a: list[list[torch.Tensor]] = []
    model_a, state_a, _ = _train(1, seen=seen_a)  # the CPU's choice: per micro-batch
    monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)
    seen_b: list[list[torch.Tensor]] = []
    events: list[tuple[str, int]] = []
    model_b, state_b, _ = _train(1, seen=seen_b, settle=_never, events=events)
    # Each step's on_step ran after the next batch's forward (read late), the last one at
    # the epoch's end; and saw the weights of its own step, not the next one's.
    assert _forwards_before_steps(events) == [*range(2, 14), 13]
    assert state_b.step_losses == state_a.step_losses and state_b.step == 13
    assert state_b.epoch_loss_sum == state_a.epoch_loss_sum
    for step_a, step_b in zip(seen_a, seen_b, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(step_a, step_b, strict=True))
    for a, b in zip(_weights(model_a), _weights(model_b), strict=True):
        assert torch.equal(a, b)


def test_a_step_that_must_be_exact_settles_at_its_own_boundary(
        fused: None, per_step: None) -> None:
    """A checkpoint due every 4 steps (``settle``), or the stop flag: those steps'
    on_step runs before the next forward."""
    events: list[tuple[str, int]] = []
    _train(1, settle=lambda step: step % 4 == 0, events=events)
    assert _forwards_before_steps(events) == [2, 3, 4, 4, 6, 7, 8, 8, 10, 11, 12, 12, 13]
    from torchgpu.launch.stop_record import StopFlag

    stop, events = StopFlag(), []

    def stopper(step: int) -> bool:
        if step == 5:
            stop.set("test")  # as a signal arriving at step 5's boundary
        return False

    _, state, _ = _train(1, settle=stopper, stop=stop, events=events)
    assert state.step == 5 and state.batch_in_epoch == 5  # stopped at that boundary
    assert _forwards_before_steps(events) == [2, 3, 4, 5, 5]  # step 5 settled first


@pytest.mark.parametrize("nan_at", [3, 13])  # a step in the middle; the epoch's last
def test_a_nan_loss_read_late_never_reaches_the_weights(
        fused: None, per_step: None, nan_at: int) -> None:
    seen: list[list[torch.Tensor]] = []
    with pytest.raises(NonFiniteLossError, match=rf"loss nan on rank 0 at step {nan_at} "):
        _train(1, loss_fn=NanAt(nan_at), seen=seen, settle=_never)
    assert len(seen) == nan_at - 1  # the steps before it recorded, none after
    # The same run reading per micro-batch stops at the same step with the same weights.
    reference: list[list[torch.Tensor]] = []
    loop_choice = loop.per_step_optimizer
    try:
        loop.per_step_optimizer = lambda device, acc: None  # type: ignore[assignment]
        with pytest.raises(NonFiniteLossError, match=rf"at step {nan_at} "):
            _train(1, loss_fn=NanAt(nan_at), seen=reference)
    finally:
        loop.per_step_optimizer = loop_choice  # type: ignore[assignment]
    for a, b in zip(seen[-1], reference[-1], strict=True):
        assert torch.equal(a, b) and bool(torch.isfinite(a).all())


def test_the_weights_after_a_nan_read_late_are_the_last_good_step_s(
        fused: None, per_step: None) -> None:
    """The step with the NaN was skipped by the fused kernel (its step count restored);
    the next one never ran: the model ends with the weights of the step before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Linear(16, 1))
    parts = loop_parts(model, torch.device("cpu"), batch_size=8, lr=1e-2,
                       loss_fn=NanAt(4), samples=100)
    kept: list[list[torch.Tensor]] = []
    with pytest.raises(NonFiniteLossError, match="at step 4 "):
        run_epoch(parts, _data(), TrainState(), batches_per_epoch=13, settle=_never,
                  on_step=lambda s: kept.append(_weights(model)))
    assert len(kept) == 3
    assert all(torch.equal(a, b) for a, b in zip(kept[-1], _weights(model), strict=True))
    assert all(p.grad is None for p in model.parameters())  # step 5's gradients dropped
    assert parts.accumulator.pending == 0
    optimizer = parts.accumulator.optimizer  # type: ignore[attr-defined]
    assert {float(s["step"]) for s in optimizer.state.values()} == {3.0}
    assert not hasattr(optimizer, "found_inf")  # the loop's flag left with the loop


@pytest.mark.parametrize(("change", "late"), [
    ({}, True), ({"accumulate": 2}, False), ({"on_nonfinite": "skip"}, False),
    ({"fused": False}, False), ({"scaled": True}, False)])
def test_which_runs_read_late(change: dict[str, Any], late: bool) -> None:
    """Late reads need a step the device can skip (a fused kernel, no loss scaler setting
    the flag itself), one micro-batch a step and --on-nonfinite stop."""
    from torchgpu.train.loop.loss_reader import reads_late

    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.AdamW([param], fused=change.get("fused", True))

    class Acc:
        scales_loss = change.get("scaled", False)

    assert reads_late(optimizer, Acc(), accumulate=change.get("accumulate", 1),
                      on_nonfinite=change.get("on_nonfinite", "stop")) is late


def test_fit_reading_late_writes_the_records_and_checkpoints_of_reading_per_micro_batch(
        fused: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``fit`` on the accelerator's path with a fused optimizer reads late (no sync per
    step) and settles at each --save-every step: its step records, checkpoints and final
    weights are those of the CPU's per-micro-batch reads."""
    from torchgpu.train.loop import loss_reader

    def run(name: str) -> Any:
        return fit(lm_factory, TokenDataset(48), epochs=2, batch_size=8, out=tmp_path / name,
                   progress="off", log_every=1, save_every=2)

    def steps(name: str) -> list[str]:
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [line for line in lines if '"kind": "step"' in line]

    a = run("a")
    modes: list[bool] = []
    made = loss_reader.LossReader.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        modes.append(self.late)

    monkeypatch.setattr(loss_reader.LossReader, "__init__", spy)
    monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)
    b = run("b")
    assert modes == [True, True]  # both epochs read late
    assert len(steps("b")) == 12 and steps("b") == steps("a")
    saved = sorted(p.name for p in (tmp_path / "a" / "checkpoints").glob("step-*"))
    assert saved == sorted(p.name for p in (tmp_path / "b" / "checkpoints").glob("step-*"))
    assert saved
    for name in saved:  # weights, optimizer, RNG (dropout) and position: the same
        a_dir, b_dir = (tmp_path / run_name / "checkpoints" / name for run_name in "ab")
        assert ((a_dir / "model.safetensors").read_bytes()
                == (b_dir / "model.safetensors").read_bytes()), name
        _assert_same(torch.load(a_dir / "state.pt", weights_only=False),
                     torch.load(b_dir / "state.pt", weights_only=False), name)
    for key, value in a.model.state_dict().items():
        assert torch.equal(b.model.state_dict()[key], value), key


TIMED = ("per_s", "seconds", "time", "wall")  # measured, so never equal between runs


def _assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            if not any(word in str(key) for word in TIMED):
                _assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif not (isinstance(a, float) and math.isnan(a) and math.isnan(b)):
        assert a == b, where


class OomOnce:
    """MSE; out of memory on the ``at``-th call (once); with ``nan_small`` a NaN for any
    micro-batch under 8 rows (the back-off's halves)."""

    def __init__(self, at: int, *, nan_small: bool = False) -> None:
        self.calls, self.at, self.nan_small = 0, at, nan_small

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = nn.functional.mse_loss(out, y)
        return loss * math.nan if self.nan_small and out.shape[0] < 8 else loss


@pytest.mark.parametrize("nan_small", [False, True])
def test_the_out_of_memory_back_off_comes_after_a_window_held_by_late_reads(
        fused: None, monkeypatch: pytest.MonkeyPatch, nan_small: bool) -> None:
    """Step 4 is held when step 5's forward runs out of memory: it is recorded before the
    back-off logs and replays step 5 (the log names step 5); a NaN in the replay stops at
    step 5 with step 4 recorded: as when each loss is read as it comes."""

    def train(late: bool) -> tuple[TrainState, list[int], str]:
        if late:
            monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)
        else:
            monkeypatch.undo()
            from torchgpu.train.recipe import optimizers

            monkeypatch.setattr(optimizers, "kernel_options", lambda params: {"fused": True})
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(13, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 1))
        state = TrainState()
        parts = loop_parts(model, torch.device("cpu"), batch_size=8, lr=1e-2, state=state,
                           loss_fn=OomOnce(5, nan_small=nan_small), samples=100)
        logged: list[int] = []
        assert parts.backoff is not None
        parts.backoff._on_event = lambda event: logged.append(state.step + 1)
        error = ""
        try:
            run_epoch(parts, _data(), state, batches_per_epoch=13,
                      settle=_never if late else None)
        except NonFiniteLossError as stopped:
            error = str(stopped).split(":")[0]
        return state, logged, error

    late, logged, error = train(True)
    reference, logged_ref, error_ref = train(False)
    assert logged == logged_ref == [5]
    assert error == error_ref and (error.startswith("loss nan on rank 0 at step 5 ")
                                   if nan_small else not error)
    assert late.step_losses == reference.step_losses
    assert len(late.step_losses) == (4 if nan_small else 13)
