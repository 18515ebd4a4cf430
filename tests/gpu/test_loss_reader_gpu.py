"""Host syncs per optimizer step on a real CUDA GPU, counted by CUDA itself
(``torch.cuda.set_sync_debug_mode("warn")`` warns at every synchronising call). The CPU
stand-in, counting host reads through a TorchFunctionMode: tests/unit/test_loss_reader.py."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

from torchgpu.bench.suites.train_step import loop_parts
from torchgpu.errors import NonFiniteLossError
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.state import TrainState

pytestmark = pytest.mark.gpu


def _batches(count: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 64, generator=g).cuda(), torch.randn(32, 1, generator=g).cuda())
            for _ in range(count)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1)).cuda()


def _never(step: int) -> bool:
    return False


def _syncs(accumulate: int, precision: str, *, late: bool = False
           ) -> tuple[int, int, list[str]]:
    """Synchronising calls between the end of the first and of the last optimizer step of
    an epoch (steady state: the epoch's start and end are not steps), the steps between,
    and where each call was made (Python's warning location)."""
    device = torch.device("cuda")
    batches = _batches(4 * accumulate * 3)
    parts = loop_parts(_model(), device, batch_size=32, lr=1e-3, accumulate=accumulate,
                       precision=precision, samples=32 * len(batches))
    state = TrainState()
    run_epoch(parts, batches[: 4 * accumulate], state,  # warm-up: kernels, cuBLAS, Adam state
              batches_per_epoch=4 * accumulate)
    torch.cuda.synchronize()
    marks: list[int] = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")

        def on_step(_: TrainState) -> None:
            marks.append(len(seen))

        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_epoch(parts, batches[4 * accumulate:], state, on_step=on_step,
                      batches_per_epoch=len(batches) - 4 * accumulate,
                      settle=_never if late else None)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    between = seen[marks[0]:marks[-1]]
    syncs = [w for w in between if "synchroniz" in str(w.message)]
    return len(syncs), len(marks) - 1, [f"{w.filename}:{w.lineno}" for w in syncs]


@pytest.mark.parametrize(("accumulate", "precision"), [(1, "fp32"), (4, "bf16")])
def test_at_most_one_host_sync_per_optimizer_step(accumulate: int, precision: str) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    syncs, steps, where = _syncs(accumulate, precision)
    assert steps == 7
    assert syncs <= steps, f"{syncs} synchronising calls in {steps} optimizer steps: {where}"


@pytest.mark.parametrize(("accumulate", "late"), [(2, False), (1, True)])
def test_a_nan_loss_on_cuda_never_reaches_the_weights(accumulate: int, late: bool) -> None:
    """Step 3's window holds the NaN: read at its step's pre-hook (a window of 2), or one
    step late (late reads: the fused kernel skipped the step on the device's flag)."""
    device = torch.device("cuda")
    calls = 0

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        loss = nn.functional.mse_loss(out, y)
        return loss * math.nan if calls == 2 * accumulate + 1 else loss

    model = _model()
    parts = loop_parts(model, device, batch_size=32, lr=1e-3, accumulate=accumulate,
                       loss_fn=loss_fn, samples=32 * 8)
    kept: list[list[torch.Tensor]] = []
    with pytest.raises(NonFiniteLossError, match="at step 3 "):
        run_epoch(parts, _batches(8), TrainState(), batches_per_epoch=8,
                  settle=_never if late else None,
                  on_step=lambda s: kept.append([p.detach().clone() for p in model.parameters()]))
    assert len(kept) == 2
    for before, now in zip(kept[-1], model.parameters(), strict=True):
        assert torch.equal(before, now.detach())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_late_reads_make_no_host_sync_between_steps(precision: str) -> None:
    """With the fused Adam torchgpu builds on CUDA and ``settle`` (as the runner passes
    it), each window's losses are read one step late from pinned memory: no synchronising
    call between the first and the last step's record."""
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    syncs, steps, where = _syncs(1, precision, late=True)
    assert steps == 7
    assert syncs == 0, f"{syncs} synchronising calls in {steps} optimizer steps: {where}"
