"""A step limit for in-process runs: :func:`train_until` stops a run after optimizer step
N, as a stop signal then would (checkpoint, ``stopped_early``), through the engine's
run hooks (:mod:`torchgpu.train.hooks.run_hooks`), which tests install around the call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchgpu.train.hooks.run_hooks import RunHook, installed
from torchgpu.train.runner import train

if TYPE_CHECKING:
    from torchgpu.launch.stop_record import StopFlag
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.outputs.report import TrainResult
    from torchgpu.train.state import TrainState


class StopAt(RunHook):
    """Set the run's stop flag after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def after_step(self, state: TrainState, stop: StopFlag) -> None:
        if state.step >= self.step:
            stop.set("step limit")


def train_until(stop_at: int | None, config: TrainConfig | None = None,
                **kwargs: Any) -> TrainResult:
    """``train(config, **kwargs)`` stopped after optimizer step ``stop_at`` (None: to
    the end)."""
    if stop_at is None:
        return train(config, **kwargs)
    with installed(StopAt(stop_at)):
        return train(config, **kwargs)
