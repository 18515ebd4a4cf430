"""The stage pipeline's own step and window in the training loop, with a stand-in trainer
(the real schedules run in tests/distributed/test_stage_run_gloo.py): what the loop's
branch for it (``LoopParts.step``) does with windows, a non-finite loss, the epoch's
short last window, the stop the ranks agreed on and the run hooks' view of the loss."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from torchgpu.errors import NonFiniteLossError
from torchgpu.launch.stop_record import StopFlag
from torchgpu.precision import Precision
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.state import TrainState
from torchgpu.train.strategies.stages.run import StageStep, StageWindow


class _Trainer:
    """Stands in for StageTrainer: each batch's loss from ``losses``; records the windows
    it applied (their rows) and dropped; reports a stop seen on another rank at batch
    ``stop_at`` (1-based)."""

    def __init__(self, losses: list[float], stop_at: int | None = None) -> None:
        self.losses, self.stop_at = iter(losses), stop_at
        self.calls = 0
        self.applied: list[int] = []
        self.dropped = 0

    def forward_backward(self, x: Tensor, y: Tensor, stop_wanted: bool) -> tuple[bool, float]:
        self.calls += 1
        return stop_wanted or self.calls == self.stop_at, next(self.losses)

    def apply(self, window_rows: int) -> None:
        self.applied.append(window_rows)

    def drop_window(self) -> None:
        self.dropped += 1


def _run(trainer: _Trainer, *, accumulate: int, batches: list[int], on_nonfinite: str = "skip",
         stop: StopFlag | None = None) -> tuple[TrainState, StageStep, Any]:
    stop = stop or StopFlag()
    window = StageWindow(trainer, accumulate)  # type: ignore[arg-type]
    step = StageStep(trainer, stop, window)  # type: ignore[arg-type]
    model = nn.Linear(3, 1)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=window,
                      precision=Precision("fp32", "cpu"), device=torch.device("cpu"),
                      accumulate=accumulate, on_nonfinite=on_nonfinite, step=step)
    data = [(torch.randn(n, 3), torch.randn(n, 1)) for n in batches]
    state = TrainState()
    totals = run_epoch(parts, data, state, batches_per_epoch=len(batches), stop=step.agreed)
    return state, step, totals


def test_windows_step_on_their_rows_and_the_short_last_window_too() -> None:
    trainer = _Trainer([1.0, 3.0, 2.0, 4.0, 6.0])
    state, _, totals = _run(trainer, accumulate=2, batches=[4, 4, 4, 4, 2])
    assert trainer.applied == [8, 8, 2]  # the epoch's last window is its one short batch
    assert state.step == 3 and state.step_losses == [2.0, 3.0, 6.0]
    assert totals.micro_batches == 5 and totals.samples == 18 and not totals.stopped


def test_a_non_finite_loss_drops_its_window_or_stops() -> None:
    trainer = _Trainer([1.0, math.nan, 2.0, 5.0])
    state, _, _ = _run(trainer, accumulate=2, batches=[4, 4, 4, 4])
    assert trainer.applied == [8] and trainer.dropped == 1  # the NaN's window is dropped
    assert state.step == 1 and state.skipped_steps == 1 and state.step_losses == [3.5]
    with pytest.raises(NonFiniteLossError, match="loss nan"):
        _run(_Trainer([1.0, math.nan]), accumulate=2, batches=[4, 4], on_nonfinite="stop")


def test_a_stop_agreed_in_the_step_ends_the_epoch_at_the_next_boundary() -> None:
    trainer = _Trainer([1.0] * 6, stop_at=3)  # another rank's stop, seen in batch 3
    stop = StopFlag()
    state, step, totals = _run(trainer, accumulate=2, batches=[4] * 6, stop=stop)
    assert totals.stopped and state.step == 2 and trainer.calls == 4
    assert step.agreed.is_set() and stop.is_set()  # the run's own flag names it too


def test_the_run_hooks_wrap_the_schedule_s_loss() -> None:
    # A hook sees each batch and its agreed loss, before the step uses it.
    trainer = _Trainer([1.0, 2.0])
    seen: list[float] = []
    window = StageWindow(trainer, 1)  # type: ignore[arg-type]
    step = StageStep(trainer, StopFlag(), window)  # type: ignore[arg-type]
    inner: Callable[[Tensor, Tensor], Tensor] = step.loss

    def hooked(x: Tensor, y: Tensor) -> Tensor:
        loss = inner(x, y)
        seen.append(float(loss))
        return loss

    step.loss = hooked
    for _ in range(2):
        step(torch.zeros(2, 3), torch.zeros(2, 1), 2, nn.MSELoss())
    assert seen == [1.0, 2.0] and trainer.applied == [2, 2]


def test_loop_parts_refuse_a_step_with_the_loop_s_own_guards() -> None:
    trainer = _Trainer([])
    window = StageWindow(trainer, 1)  # type: ignore[arg-type]
    step = StageStep(trainer, StopFlag(), window)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="leave agree, backoff and layout unset"):
        LoopParts(model=nn.Linear(3, 1), loss_fn=nn.MSELoss(), accumulator=window,
                  precision=Precision("fp32", "cpu"), device=torch.device("cpu"),
                  agree=True, step=step)
