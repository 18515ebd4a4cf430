"""The epoch's last windows are weighted by samples: the loop with a layout (and under
an OOM back-off) trains exactly like the big batch; an empty batch gives zero gradients."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchgpu.accumulate import GradAccumulator
from torchgpu.data.shards import ShardLayout
from torchgpu.models import HousingNet
from torchgpu.precision import Precision
from torchgpu.train.loop.backoff import LoopBackoff
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.loop.tail import EmptySafeLoss, TailWindows
from torchgpu.train.state import TrainState

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _batches(batch: int, samples: int = 84) -> Batches:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(samples, 13, generator=g), torch.randn(samples, 1, generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, samples, batch)]


def _train(batch: int, accumulate: int, *, layout: bool, limit: int | None = None,
           epochs: int = 2) -> tuple[nn.Module, TrainState, int]:
    torch.manual_seed(0)
    model = HousingNet()
    if limit is not None:  # a forward hook "runs out of memory" above ``limit`` samples
        def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            if int(inputs[0].shape[0]) > limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 MiB")

        model.register_forward_pre_hook(hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    precision = Precision("fp32", "cpu")
    acc = GradAccumulator(model, optimizer, accumulate, precision=precision)
    backoff = (LoopBackoff(model, acc, nn.MSELoss(), batch_size=batch, accumulate=accumulate)
               if limit is not None else None)
    batches = _batches(batch)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc, precision=precision,
                      device=torch.device("cpu"), accumulate=accumulate, backoff=backoff,
                      layout=ShardLayout(84, 1, batch) if layout else None)
    state = TrainState()
    for epoch in range(epochs):
        state.begin_epoch(epoch)
        run_epoch(parts, batches, state, batches_per_epoch=len(batches))
    assert acc.window_samples is None and acc.steps == accumulate  # restored at the end
    return model, state, len(backoff.events) if backoff is not None else 0


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("limit", [None, 4])  # 4: backed off to pieces of 4 samples
def test_short_last_micro_batch_trains_like_the_big_batch(limit: int | None) -> None:
    big, big_state, _ = _train(24, 1, layout=False)  # 24, 24, 24, 12
    small, state, backoffs = _train(8, 3, layout=True, limit=limit)  # (8, 8, 8) x3, (8, 4)
    assert backoffs == (0 if limit is None else 1)  # 8 -> 4
    assert state.step == big_state.step == 8
    assert _max_diff(big, small) < 1e-6
    unweighted, _, _ = _train(8, 3, layout=False)  # negative control: equal weights
    assert _max_diff(big, unweighted) > 1e-4


def test_tail_starts_where_a_window_can_reach_the_short_batch() -> None:
    layout = ShardLayout(84, 1, 8)  # batches 0..10, batch 10 holds 4
    assert layout.first_short == 10
    tail = TailWindows(layout, 3, layout.batches, nn.MSELoss())
    assert tail.start == 8
    model = nn.Linear(2, 1)
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.1), 3)
    assert tail.batch(acc, 9, 8) == 1.0
    assert acc.steps == 2 and acc.window_samples == 12.0  # batches 9 and 10: 8 + 4
    even = ShardLayout(96, 2, 8)
    assert TailWindows(even, 3, even.batches, nn.MSELoss()).start > 10**9  # never


def test_empty_batch_loss_is_zero_with_zero_gradients() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    loss_fn = EmptySafeLoss(nn.MSELoss())
    out = model(torch.zeros(0, 3))
    loss = loss_fn(out, torch.zeros(0, 1))
    assert loss.item() == 0.0
    loss.backward()  # type: ignore[no-untyped-call]
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.count_nonzero(g) == 0 for g in grads)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    assert loss_fn(model(x), y).item() == pytest.approx(nn.MSELoss()(model(x), y).item())
