"""Regression tests from a second reading of the loop's pieces: an OOM in backward frees
the failed try's graph before the replay, clipping switched on after construction is
honoured by the one-micro-batch fast path, and a skipped window's losses leave the
epoch's train loss in one process as under DDP."""

from __future__ import annotations

import gc
import math
import time
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd import Function

from torchgpu.accumulate import GradAccumulator
from torchgpu.precision import Precision
from torchgpu.train.loop import epoch
from torchgpu.train.loop.backoff import LoopBackoff
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.state import TrainState

LIMIT = 16


class _OOMInBackward(Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.rows = x.shape[0]
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.rows > LIMIT:
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated, in backward)")
        return grad


def test_an_oom_in_backward_frees_the_failed_try_before_the_replay() -> None:
    losses: list[tuple[int, Any]] = []
    seen: list[list[int]] = []

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(13, 64), nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] <= LIMIT and not seen:  # the replay's first forward
                gc.collect()
                seen.append([r for r, ref in losses if r > LIMIT and ref() is not None])
            return self.b(_OOMInBackward.apply(torch.relu(self.a(x)).pow(2)))

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(out, y)
        losses.append((out.shape[0], weakref.ref(loss)))
        return loss

    torch.manual_seed(0)
    model = Net()
    prec = Precision("fp32", "cpu")
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.01), 1,
                          precision=prec, zero_after_step=False)
    backoff = LoopBackoff(model, acc, loss_fn, batch_size=64, accumulate=1)
    parts = LoopParts(model=model, loss_fn=loss_fn, accumulator=acc, precision=prec,
                      device=torch.device("cpu"), backoff=backoff)
    batches = [(torch.randn(64, 13), torch.randn(64, 1))]
    run_epoch(parts, batches, TrainState(), batches_per_epoch=1)
    assert backoff.events and seen == [[]]  # no failed-try loss alive at the replay


def test_clipping_set_after_construction_is_honoured_by_the_fast_path() -> None:
    model = nn.Linear(3, 1)
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), 1,
                          zero_after_step=False)
    acc.clip_norm = 1e-3
    loss = model(torch.full((4, 3), 100.0)).pow(2).mean()
    acc.backward(loss)
    assert acc.last_grad_norm is not None
    total = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    assert float(total.norm()) <= 1e-3 * 1.01


def test_a_skipped_window_leaves_the_epoch_loss_in_one_process() -> None:
    class Poisoned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 1)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            out = self.lin(x)
            return out * math.nan if self.calls == 2 else out  # the window's 2nd batch

    model = Poisoned()
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), 2,
                          zero_after_step=False)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc,
                      precision=Precision("fp32", "cpu"), device=torch.device("cpu"),
                      accumulate=2, on_nonfinite="skip")
    x, y = torch.ones(4, 2), torch.zeros(4, 1)
    state = TrainState()
    run_epoch(parts, [(x, y)] * 4, state, batches_per_epoch=4)
    assert state.skipped_steps == 1 and state.step == 1
    assert state.epoch_loss_count == 2  # the kept window's two losses only


def test_the_data_wait_counts_the_loaders_time_not_the_progress_lines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop reads the clock once per step: the wait for a batch starts when the step
    before it ended; a progress refresh in between is not counted as waiting."""
    model = nn.Linear(3, 1)
    prec = Precision("fp32", "cpu")
    acc = GradAccumulator(model, torch.optim.SGD(model.parameters(), lr=0.0), 1,
                          precision=prec, zero_after_step=False)
    parts = LoopParts(model=model, loss_fn=nn.functional.mse_loss, accumulator=acc,
                      precision=prec, device=torch.device("cpu"))
    batch = (torch.randn(4, 3), torch.randn(4, 1))

    def slow_batches(seconds: float) -> Any:
        for _ in range(6):
            time.sleep(seconds)
            yield batch

    class SlowBar:
        updates = 0

        def update(self, state: TrainState, loss: float, rate: float) -> None:
            self.updates += 1
            time.sleep(0.15)

    monkeypatch.setattr(epoch, "UI_INTERVAL_S", 0.0)  # a refresh due after every step
    bar = SlowBar()
    quick = run_epoch(parts, slow_batches(0.0), TrainState(), batches_per_epoch=6,
                      progress=bar)
    assert bar.updates == 6 and quick.seconds >= 0.9
    assert quick.data_wait_s < 0.05  # 0.9 s of refreshes, none of it waiting
    slow = run_epoch(parts, slow_batches(0.05), TrainState(), batches_per_epoch=6)
    assert 0.3 <= slow.data_wait_s <= slow.seconds
    assert 0.05 <= slow.first_wait_s < 0.3
