"""What a strategy hands the run driver for one run: :class:`RunSteps`.

The driver (``train.runner``) is the same for every strategy; what differs comes from the
object ``Strategy.steps`` returns: the loop's parts, the stop flag, what a checkpoint saves
(``model`` under canonical keys and ``optimizer``; :meth:`RunSteps.before_save` runs on every
rank first), evaluation, the full weights and the summary's entries. ``ModelSteps`` is
the default: one model object (placed and wrapped by the strategy), its optimizer through
the engine's accumulator, OOM back-off where the strategy allows it and, under DDP, the
ranks' agreement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.hooks.run_hooks import RunHooks
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.outputs.evaluation import EvalResult, evaluate
from torchgpu.train.state import TrainState

if TYPE_CHECKING:
    from torchgpu.launch.heartbeat import Heartbeat
    from torchgpu.precision import Precision
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.task import Task


@dataclass(frozen=True)
class StepContext:
    """What the driver knows when it asks the strategy for its steps.

    ``model``: placed and wrapped by the strategy. ``agree``: several ranks train
    together. ``hooks``: the run's hooks (:mod:`torchgpu.train.hooks.run_hooks`), whose
    :meth:`~torchgpu.train.hooks.run_hooks.RunHooks.wrap_loss` goes before where this
    strategy's step first waits on the other ranks. ``position()``: the
    run's (optimizer steps, epoch) once it runs. ``layout``: how the epoch's samples fall
    on the ranks (the training loader's). ``resume_from``: the checkpoint the run plans
    to resume from (None: a fresh start).
    """

    config: TrainConfig
    rank: int
    world: int
    agree: bool
    device: torch.device
    task: Task
    model: nn.Module
    precision: Precision
    stop: StopFlag
    out_dir: Path | None
    heartbeat: Heartbeat | None = None
    hooks: RunHooks = field(default_factory=RunHooks)
    position: Callable[[], tuple[int, int]] = lambda: (0, 0)
    layout: Any = None
    resume_from: Path | None = None


class RunSteps:
    """What one strategy's run supplies to the driver.

    Subclasses set the attributes in ``__init__``; the methods here are the defaults.
    """

    config: TrainConfig  # the run's settings as this strategy resolved them
    parts: LoopParts
    stop: StopFlag
    model: nn.Module  # saved and restored by checkpoints (canonical keys)
    optimizer: Any  # saved and restored by checkpoints (state_dict / load_state_dict)
    observed: nn.Module  # what the profiler marks and the memory recorder names
    result_model: nn.Module  # TrainResult.model
    record_world: int = 1  # processes whose samples an epoch's throughput adds up
    phase: str = "training"  # the heartbeat's phase while a step runs

    def lines(self) -> tuple[str, ...]:
        """Console lines rank 0 prints when the run starts (after the notes)."""
        return ()

    def before_save(self) -> None:
        """Called on every rank before each checkpoint save (collective if it gathers)."""

    def evaluate(self, batches: Iterable[Any]) -> EvalResult:
        """The held-out metrics after an epoch (the same on every rank)."""
        raise NotImplementedError

    def full_state(self) -> dict[str, Tensor]:
        """The whole model's weights under canonical keys for ``model.safetensors``
        (rank 0 writes it; collective where the weights are spread over the ranks)."""
        raise NotImplementedError

    def summarize(self, summary: dict[str, Any], state: TrainState,
                  train_seconds: float) -> None:
        """Add this strategy's entries to ``summary`` (every rank; rank 0 writes it)."""


class ModelSteps(RunSteps):
    """The default steps: one model object, its optimizer and the engine's accumulator.

    What they need of the strategy (:meth:`Strategy.steps
    <torchgpu.train.strategies.Strategy.steps>` passes it) comes as arguments:
    ``backoff``: whether the engine's OOM back-off may run (False: the strategy refuses
    it); ``target_device``: where the output lives when not on the run's device (labels
    go there); ``eval_model``: the module evaluation calls; ``full_state``: the whole
    model's weights under canonical keys, from the wrapped model.
    """

    def __init__(self, ctx: StepContext, *, backoff: bool,
                 target_device: torch.device | None, eval_model: nn.Module,
                 full_state: Callable[[nn.Module], dict[str, Tensor]]) -> None:
        from torchgpu.accumulate import GradAccumulator
        from torchgpu.parallel.data import unwrap
        from torchgpu.train.guards.agreement import RankAgreement
        from torchgpu.train.loop.backoff import for_run as backoff_for_run

        config, model, device, task = ctx.config, ctx.model, ctx.device, ctx.task
        assert config.batch_size is not None and config.lr is not None
        optimizer = task.make_optimizer(model, config.lr)
        acc = GradAccumulator(model, optimizer, config.accumulate, precision=ctx.precision,
                              clip_norm=config.clip_norm, zero_after_step=False)
        position = ctx.position  # the hooks' loss goes before the gradient all-reduce
        loss_fn = ctx.hooks.wrap_loss(task.loss, lambda: position()[0])
        if target_device == device:
            target_device = None
        run_backoff = None if not backoff else backoff_for_run(
            model, acc, loss_fn, ctx.precision, batch_size=config.batch_size,
            accumulate=config.accumulate, device=device, distributed=ctx.agree,
            out_dir=ctx.out_dir, position=ctx.position)
        self.parts = LoopParts(
            model=model, loss_fn=loss_fn, accumulator=acc, precision=ctx.precision,
            device=device, accumulate=config.accumulate,
            move_batches=device.type not in ("cpu", "cuda"),
            on_nonfinite=config.on_nonfinite, rank=ctx.rank, agree=ctx.agree,
            target_device=target_device, backoff=run_backoff,
            agreement=RankAgreement(ctx.world, heartbeat=ctx.heartbeat) if ctx.agree else None,
            layout=ctx.layout)
        self.config, self.stop, self.optimizer = config, ctx.stop, optimizer
        self.model = self.observed = model
        self.result_model = unwrap(model)
        self.record_world = ctx.world
        self._full_state, self._task, self._device = full_state, task, device
        self._precision, self._target_device = ctx.precision, target_device
        self._eval_model = eval_model

    def evaluate(self, batches: Iterable[Any]) -> EvalResult:
        task = self._task
        return evaluate(self._eval_model, batches, task.loss,
                        device=self._device, precision=self._precision,
                        target_device=self._target_device, metrics=task.metrics)

    def full_state(self) -> dict[str, Tensor]:
        return self._full_state(self.model)

    def summarize(self, summary: dict[str, Any], state: TrainState,
                  train_seconds: float) -> None:
        from torchgpu.train.recipe.compiling import compile_summary

        compiled = compile_summary(self.model)
        if compiled is not None:
            summary["compile"] = compiled
        backoff = self.parts.backoff
        if backoff is not None:
            summary["oom_backoffs"] = [event.as_dict() for event in backoff.events]
