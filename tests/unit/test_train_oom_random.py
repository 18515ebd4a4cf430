"""OOM back-off replays a window with the random numbers of its first try: a model with
dropout whose out-of-memory error strikes after dropout drew (later in the forward, or
in backward) trains, after backing off, bitwise as a run started at the smaller
micro-batch. CPU: hooks raise ``torch.OutOfMemoryError`` above a micro-batch limit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from torchgpu.accumulate import GradAccumulator
from torchgpu.precision import Precision
from torchgpu.train.loop import epoch as loop
from torchgpu.train.loop.backoff import LoopBackoff
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.loop.random_state import WindowRandomState
from torchgpu.train.state import TrainState

Batches = list[tuple[torch.Tensor, torch.Tensor]]



@pytest.fixture(autouse=True, params=["micro-batch", "step"])
def loss_read(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case with the loss read per micro-batch (the CPU's way) and once per
    optimizer step (an accelerator's: torchgpu.train.loop.loss_reader)."""
    if request.param == "step":
        monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)

def _batches(batch: int, samples: int = 128) -> Batches:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(samples, 13, generator=g), torch.randn(samples, 1, generator=g)
    return list(zip(x.split(batch), y.split(batch), strict=True))


def _oom_above(limit: int) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        rows = int((args[0] if isinstance(args, tuple) else args).shape[0])
        if module.training and rows > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (simulated, {rows} rows)")

    return hook


def _run(batch: int, accumulate: int, limit: int | None = None, where: str = "forward",
         dropout: float = 0.5) -> tuple[nn.Module, LoopBackoff | None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Dropout(dropout), nn.Linear(32, 1))
    if limit is not None and where == "forward":  # after the dropout drew its mask
        model[3].register_forward_pre_hook(_oom_above(limit))
    elif limit is not None:  # in backward, after the whole forward
        model[3].register_full_backward_pre_hook(lambda m, g: _oom_above(limit)(m, g))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    precision = Precision("fp32", "cpu")
    acc = GradAccumulator(model, optimizer, accumulate, precision=precision)
    backoff = LoopBackoff(model, acc, nn.MSELoss(), batch_size=batch, accumulate=accumulate)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc, precision=precision,
                      device=torch.device("cpu"), accumulate=accumulate, backoff=backoff)
    state = TrainState()
    for epoch in range(2):
        state.begin_epoch(epoch)
        run_epoch(parts, _batches(batch), state, batches_per_epoch=len(_batches(batch)))
    return model, backoff


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize(("batch", "accumulate", "limit"), [(32, 1, 8), (16, 2, 4)])
def test_back_off_after_dropout_drew_equals_a_run_started_smaller(
        where: str, batch: int, accumulate: int, limit: int) -> None:
    model, backoff = _run(batch, accumulate, limit, where)
    assert backoff is not None and backoff.micro_batch == limit and backoff.events
    pieces = batch // limit
    reference, _ = _run(limit, accumulate * pieces)
    for key, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_random_state_is_kept_only_for_steps_that_draw() -> None:
    _, drawing = _run(32, 1)
    assert drawing is not None and drawing.random_state.armed  # dropout draws every step
    _, still = _run(32, 1, dropout=0.0)
    assert still is not None and not still.random_state.armed  # nothing drawn: not kept
    keeper = WindowRandomState("cpu")
    keeper.mark()
    first = torch.rand(3)
    keeper.restore()
    assert torch.equal(torch.rand(3), first)
