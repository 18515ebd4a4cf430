"""The shape every strategy has: :class:`Strategy`, its :class:`Features`, a ``Choice``.

A strategy places the run's device, wraps the model, gives its full state and the model
evaluation runs on, shards the data, and supplies what its run does differently from the
shared driver (``Strategy.steps``). What it supports is declared in ``Features``
(with the reason for each refusal), so the checks that follow from the declarations alone
are made once for every strategy (``strategies.checks``) and name it and its reason.
Strategy objects hold no run state: one instance per strategy, shared by every run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchgpu.errors import UsageError
from torchgpu.train.strategies.shard import Shard

if TYPE_CHECKING:
    # torch, and torchgpu.parallel (which imports it), only here and inside methods: the
    # CLI builds its parser from the strategies' names and help without importing torch.
    import torch
    from torch import Tensor, nn

    from torchgpu.distributed import DistEnv
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.strategies.run_steps import RunSteps, StepContext
    from torchgpu.train.task import Task

#: Every --precision value; a strategy's ``precisions`` is a subset.
ALL_PRECISIONS: tuple[str, ...] = ("fp32", "bf16", "fp16", "auto")


@dataclass(frozen=True)
class Features:
    """What a strategy supports. A ``str`` field is ``None`` where the feature works,
    else the reason it cannot (shown to the user with the fix)."""

    resume: str | None = None  # --save-every / --resume
    backoff: str | None = None  # out-of-memory back-off inside the loop
    auto_batch: str | None = None  # --batch-size auto
    precisions: tuple[str, ...] = ALL_PRECISIONS
    precision_why: str = ""  # why the others are refused
    # Strategy-only flags it takes (TrainConfig field names): chunks, schedule, balance,
    # devices. Any other strategy refuses them.
    flags: frozenset[str] = frozenset()
    # The estimator's name for it (torchgpu.estimate_memory's strategy=), None: no model.
    estimate: str | None = None
    compile: str | None = None  # --compile
    # Checkpoints are sharded: every rank writes its own part of the model and optimizer
    # (torchgpu.checkpoint.sharded) instead of rank 0 writing one file.
    sharded_checkpoints: bool = False


@dataclass(frozen=True)
class Choice:
    """The strategy that runs for a requested one, and notes explaining a fallback."""

    strategy: Strategy
    notes: tuple[str, ...] = ()

    @property
    def mode(self) -> str:
        """The name of the strategy that runs (``single``, ``ddp``, ...)."""
        return self.strategy.name


class Strategy:
    """One training strategy (subclass it; see the module docstring).

    ``processes``: ``"one"`` (runs in one process; several are refused), ``"several"``
    (one per device; in one process it falls back to ``alone``), ``"any"``.
    Every strategy runs through the same run driver and loop
    (:func:`torchgpu.train.runner.train`, :func:`torchgpu.train.loop.epoch.run_epoch`);
    ``steps`` supplies what its run does differently.
    """

    name: str = ""
    label: str = ""  # how messages name it ("pipeline with several processes (--nproc)")
    help: str = ""
    processes: str = "any"
    features: Features = Features()

    def __repr__(self) -> str:
        return f"<strategy {self.label or self.name}>"

    @property
    def described(self) -> str:
        """``--strategy NAME`` or the label when the name alone is ambiguous."""
        return self.label or f"--strategy {self.name}"

    # -- validation ----------------------------------------------------------------------
    def for_processes(self, nproc: int) -> Strategy:
        """The strategy that runs with ``nproc`` processes (the pipeline's stage variant)."""
        return self

    def check(self, config: TrainConfig, nproc: int) -> None:
        """Refuse this strategy's own bad flag combinations (pure; no device looked at).
        The feature checks common to all strategies are made before this."""

    # -- deciding ------------------------------------------------------------------------
    def choose(self, world: int, device: torch.device) -> Choice:
        """What runs when this strategy is asked for with ``world`` processes."""
        if self.processes == "one" and world > 1:
            raise UsageError(self.one_process_message(world))
        if self.processes == "several" and world == 1:
            return Choice(self.alone(), (
                f"note: --strategy {self.name} with one process has nothing to synchronise; "
                f"training as single on {device}. Start several with --nproc N.",))
        return Choice(self.for_processes(world))

    def alone(self) -> Strategy:
        """What a several-process strategy runs as in one process."""
        return self

    def check_task(self, task: Task, build_model: Callable[[], nn.Module]) -> None:
        """Refuse (UsageError) a model or data this strategy cannot train. A launcher calls
        it before any worker starts, so the refusal is one message, printed once;
        ``build_model`` builds the model (call it only when the check needs the model).
        Default: nothing to check."""

    def one_process_message(self, world: int) -> str:
        return (f"--strategy {self.name} runs in one process but {world} processes were "
                "started: every process would train its own copy. Use --strategy ddp (or "
                "fsdp) with --nproc, or drop --nproc.")

    def place(self, config: TrainConfig, env: DistEnv) -> torch.device | None:
        """This process's device when the strategy places it (stage devices); None: the
        run's ``--device`` decides."""
        return None

    def device_note(self, config: TrainConfig) -> str | None:
        """The console's device line when the strategy placed the devices, else None."""
        return None

    # -- the model -----------------------------------------------------------------------
    def wrap(self, model: nn.Module, config: TrainConfig, task: Task,
             device: torch.device) -> tuple[nn.Module, tuple[str, ...]]:
        """``model`` (activation checkpointing already applied) placed and wrapped for
        training; notes to show. Default: moved to ``device``."""
        model.to(device)  # in place; a model's own .to() override may return nothing
        return model, ()

    def full_state(self, model: nn.Module) -> dict[str, Tensor]:
        """The whole model's weights under canonical keys, for the final save (collective
        where the weights are sharded: call on every rank)."""
        from torch import Tensor

        from torchgpu.parallel.data import unwrap

        state = unwrap(model).state_dict()
        # Left on their device: the writer finds tied weights by storage before copying.
        return {k: v.detach() for k, v in state.items() if isinstance(v, Tensor)}

    def eval_model(self, model: nn.Module) -> nn.Module:
        """The module evaluation calls (the unwrapped one: no collectives in eval)."""
        from torchgpu.parallel.data import unwrap

        return unwrap(model)

    def output_device(self, model: nn.Module) -> torch.device | None:
        """Where the output lives when not on the run's device (labels go there)."""
        return None

    # -- the run -------------------------------------------------------------------------
    def shard(self, rank: int, world: int) -> Shard:
        """This rank's slice of the training order (the loader's ``dist``). Default: its
        own share of every global batch (data parallelism; one process: all of it)."""
        return Shard(rank, world)

    def steps(self, ctx: StepContext) -> RunSteps:
        """What this strategy's run supplies to the run driver (see
        :mod:`torchgpu.train.strategies.run_steps`). Default: the wrapped model, its optimizer and
        the engine's accumulator (:class:`~torchgpu.train.strategies.run_steps.ModelSteps`)."""
        from torchgpu.train.strategies.run_steps import ModelSteps

        return ModelSteps(ctx, backoff=self.features.backoff is None,
                          target_device=self.output_device(ctx.model),
                          eval_model=self.eval_model(ctx.model), full_state=self.full_state)


def processes(config: Any) -> int:
    """Processes the run has: ``--nproc``, else torchrun's ``WORLD_SIZE`` (workers get no
    ``--nproc``), else 1."""
    if config.nproc is not None:
        return int(config.nproc) * int(config.nnodes)
    import os

    world = os.environ.get("WORLD_SIZE", "")
    return int(world) if world.isdigit() and int(world) > 0 else 1
