"""The run's learning-rate schedule: ``--lr-schedule``/``--scheduler`` and ``fit(...)``.

A built-in schedule (:func:`built_in`) scales the optimizer's learning rate per optimizer
step over the run's total ``T`` (epochs times optimizer steps per epoch, so ``--batch-size
auto``, which keeps the effective batch, keeps ``T``). A factory ``optimizer ->
LRScheduler`` meets a probe optimizer at assembly (:func:`check`), so a bad one is refused
before ``--out`` exists. Either way the scheduler steps once per *applied* optimizer step
(not per micro-batch, replay, or dropped or skipped step: Hugging Face's Trainer's rule),
on every rank alike; its state is in every checkpoint, and each step's learning rate is
kept in ``TrainState.step_lrs`` (``lr`` in ``metrics.jsonl``, drawn under the loss plot).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torchgpu.errors import ConfigError, TorchGpuError, UsageError, first_line

if TYPE_CHECKING:
    import torch
    from torch import nn

    from torchgpu.train.config import TrainConfig
    from torchgpu.train.state import TrainState
    from torchgpu.train.task import Task

SCHEDULES: tuple[str, ...] = ("constant", "linear", "cosine", "step")
DEFAULT_STEP_SIZE = 1  # epochs, as torch/examples' MNIST StepLR(step_size=1, ...)
DEFAULT_GAMMA = 0.1  # torch's StepLR default
#: The settings a resumed run must share with the checkpoint (its schedule's meaning).
FIXED: tuple[str, ...] = ("lr_schedule", "warmup_steps", "lr_step_size", "lr_gamma",
                          "scheduler")
#: A factory ``optimizer -> LRScheduler`` (``fit(scheduler=...)``, ``--scheduler SPEC``).
SchedulerFactory = Callable[[Any], Any]
StepHook = Callable[["TrainState"], None]


# -- checking the settings (pure: before anything exists) -------------------------------

def validate(config: TrainConfig) -> None:
    """ConfigError / UsageError for a bad schedule setting or combination."""
    if config.lr_schedule not in SCHEDULES:
        raise ConfigError(
            f"unknown lr_schedule {config.lr_schedule!r}: allowed are {', '.join(SCHEDULES)}. "
            "Pass one of them with --lr-schedule, e.g. --lr-schedule cosine.")
    if config.warmup_steps < 0:
        raise ConfigError(
            f"--warmup-steps {config.warmup_steps} is out of range: it must be >= 0 "
            "(optimizer steps of linear warm-up from LR 0). Pass e.g. --warmup-steps 100, "
            "or 0 for none.")
    step_flags = [f"--{name.replace('_', '-')} {value}" for name, value in
                  (("lr_step_size", config.lr_step_size), ("lr_gamma", config.lr_gamma))
                  if value is not None]
    if step_flags and config.lr_schedule != "step":
        raise UsageError(
            f"{' and '.join(step_flags)} only apply to --lr-schedule step, but the schedule "
            f"is {config.lr_schedule}: add --lr-schedule step, or drop them.")
    if config.lr_step_size is not None and config.lr_step_size < 1:
        raise ConfigError(
            f"--lr-step-size {config.lr_step_size} is out of range: it must be >= 1 (epochs "
            "between decays of the learning rate by --lr-gamma). Pass e.g. --lr-step-size 1.")
    if config.lr_gamma is not None and not (math.isfinite(config.lr_gamma)
                                            and config.lr_gamma > 0):
        raise ConfigError(
            f"--lr-gamma {config.lr_gamma} must be a positive finite number (the factor the "
            "learning rate is multiplied by every --lr-step-size epochs), e.g. --lr-gamma 0.7.")
    if config.scheduler is not None:
        if ":" not in config.scheduler.strip(":"):
            raise UsageError(
                f"--scheduler {config.scheduler} is not a spec: write module.path:function or "
                "path/to/file.py:function naming a function optimizer -> "
                "torch.optim.lr_scheduler.LRScheduler.")
        _refuse_both(config, f"--scheduler {config.scheduler}")


def _refuse_both(config: TrainConfig, named: str) -> None:
    if config.lr_schedule != "constant" or config.warmup_steps:
        given = (f"--lr-schedule {config.lr_schedule}" if config.lr_schedule != "constant"
                 else f"--warmup-steps {config.warmup_steps}")
        raise UsageError(
            f"{named} and {given} were both given: the scheduler factory sets the whole "
            "schedule (warm-up included). Pass one of them.")


def resolve(spec: str) -> SchedulerFactory:
    """The factory a ``--scheduler`` spec names (UsageError when it does not resolve)."""
    from torchgpu.factories import resolve_callable

    return resolve_callable(spec, "scheduler")


# -- building ---------------------------------------------------------------------------

def factor(kind: str, step: int, *, warmup: int, total: int, steps_per_epoch: int = 1,
           step_size: int = DEFAULT_STEP_SIZE, gamma: float = DEFAULT_GAMMA) -> float:
    """The factor of the base learning rate at optimizer step ``step`` (0-based) of ``total``.

    Warm-up (every kind): ``step / warmup``, from 0. Then ``linear`` and ``cosine`` decay to 0
    at ``total`` as Hugging Face's ``get_*_schedule_with_warmup`` do; ``step`` is
    ``gamma ** (epoch // step_size)``, as ``StepLR`` stepped once per epoch; ``constant`` is 1."""
    if step < warmup:
        return step / max(1, warmup)
    if kind == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    if kind == "cosine":
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    if kind == "step":
        return float(gamma ** ((step // max(1, steps_per_epoch)) // step_size))
    return 1.0


def _factory_name(factory: Any) -> str:
    return str(getattr(factory, "__qualname__", type(factory).__name__))


def make(factory: SchedulerFactory, optimizer: torch.optim.Optimizer, named: str) -> Any:
    """``factory(optimizer)``, checked: UsageError naming ``named`` (the spec or the
    factory) when it fails, or returns no scheduler of this optimizer that steps without
    arguments and saves its state (checked to fit a weights-only checkpoint)."""
    import torch

    from torchgpu.checkpoint.layout import check_weights_only_safe

    fix = ("pass a function optimizer -> torch.optim.lr_scheduler.LRScheduler, e.g. "
           "lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)")
    try:
        made = factory(optimizer)
    except TorchGpuError:
        raise
    except Exception as error:
        raise UsageError(
            f"the scheduler factory {named} failed on the run's optimizer "
            f"({first_line(error)}): {fix}") from None
    missing = [name for name in ("step", "state_dict", "load_state_dict")
               if not callable(getattr(made, name, None))]
    if missing:
        raise UsageError(
            f"the scheduler factory {named} returned a {type(made).__name__}, not a learning-"
            f"rate scheduler (it has no {', '.join(missing)}){_hint(made)}: {fix}")
    if isinstance(made, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UsageError(
            f"the scheduler factory {named} returned a ReduceLROnPlateau, which steps on a "
            "metric; torchgpu steps the scheduler once per optimizer step, without "
            f"arguments: {fix}")
    if getattr(made, "optimizer", optimizer) is not optimizer:
        raise UsageError(
            f"the scheduler factory {named} returned a {type(made).__name__} of another "
            "optimizer, so it would never change the run's learning rate: build it on the "
            f"optimizer the factory is given. {fix}")
    try:
        check_weights_only_safe(made.state_dict(), "its state_dict()")
    except TorchGpuError as error:
        raise UsageError(
            f"the scheduler factory {named} returned a {type(made).__name__} whose state "
            f"cannot be saved in a checkpoint: {error}") from None
    return made


def _hint(made: object) -> str:
    """What a factory's usual wrong return value means (the common slips of a recipe)."""
    if made is None:
        return "; it returned nothing: add `return scheduler` at its end"
    if isinstance(made, dict) and "scheduler" in made:  # Lightning's configure_optimizers
        return ("; a Lightning-style {'scheduler': ...} dict: return its scheduler itself, "
                "which torchgpu steps once per optimizer step (interval 'step')")
    if callable(made):  # the LR factor function rather than a scheduler of it
        return ("; a function: if it is the learning-rate factor of a step, return "
                "torch.optim.lr_scheduler.LambdaLR(optimizer, that_function)")
    return ""


def built_in(config: TrainConfig, optimizer: torch.optim.Optimizer, total: int,
             steps_per_epoch: int) -> Any:
    """The LambdaLR of ``config``'s built-in schedule over ``optimizer`` (the ``step``
    schedule without warm-up: a ``StepLR`` of ``lr_step_size`` epochs of optimizer
    steps, bitwise the LRs of torch's ``StepLR`` stepped once per epoch)."""
    import torch

    kind, warmup = config.lr_schedule, config.warmup_steps
    step_size = config.lr_step_size or DEFAULT_STEP_SIZE
    gamma = config.lr_gamma if config.lr_gamma is not None else DEFAULT_GAMMA
    if kind == "step" and not warmup:
        # torch's own StepLR, over optimizer steps: it multiplies the current LR by gamma
        # at each decay, so the LRs are StepLR's stepped per epoch to the last bit (the
        # factor gamma ** k of a LambdaLR differs from that product in the last bit from
        # the fourth decay by 0.7 on).
        return torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=step_size * max(1, steps_per_epoch), gamma=gamma)

    # A plain function (not a callable object): LambdaLR saves no state for it, so a
    # resume keeps this run's total (a resume may add epochs).
    def lr_factor(step: int) -> float:
        return factor(kind, step, warmup=warmup, total=total,
                      steps_per_epoch=steps_per_epoch, step_size=step_size, gamma=gamma)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind a run's checkpointed optimizer (the stage pipeline's
    gathering wrapper holds it as ``.optimizer``)."""
    import torch

    inner = optimizer if isinstance(optimizer, torch.optim.Optimizer) else getattr(
        optimizer, "optimizer", None)
    assert isinstance(inner, torch.optim.Optimizer), type(optimizer)
    return inner


def for_run(config: TrainConfig, task: Task, optimizer: Any, steps_per_epoch: int,
            *, warn: bool = False) -> Any:
    """The run's scheduler over ``optimizer`` (None: a constant LR without warm-up and no
    factory). ``steps_per_epoch``: optimizer steps per epoch. ``warn``: print a warning
    (rank 0) when the warm-up is longer than the run."""
    assert config.epochs is not None
    inner = torch_optimizer(optimizer)
    factory = task.scheduler
    if factory is not None:
        return make(factory, inner, _named(config, factory))
    if config.lr_schedule == "constant" and not config.warmup_steps:
        return None
    total = steps_per_epoch * config.epochs
    if warn and config.warmup_steps > total:
        print(f"warning: --warmup-steps {config.warmup_steps} is longer than the run's "
              f"{total} optimizer steps: the learning rate never reaches --lr "
              f"({config.lr_schedule} schedule). Lower --warmup-steps or add epochs.",
              file=sys.stderr)
    return built_in(config, inner, total, steps_per_epoch)


def _named(config: TrainConfig, factory: Any) -> str:
    return (f"--scheduler {config.scheduler}" if config.scheduler is not None
            else _factory_name(factory))


def check(config: TrainConfig, task: Task, model: nn.Module | None) -> None:
    """At assembly, before ``--out`` exists: a scheduler factory meets a probe optimizer
    (the run's optimizer over ``model``, or over one stand-in parameter when no model is
    built here); UsageError (exit 2) naming it when it returns no usable scheduler."""
    if task.scheduler is None:
        return
    _refuse_both(config, f"the scheduler factory {_named(config, task.scheduler)}")
    import torch
    from torch import nn

    from torchgpu.train.recipe import optimizers

    assert config.lr is not None
    if model is not None:
        probe_optimizer = task.make_optimizer(model, config.lr)
    else:
        try:  # a launcher builds no model: the workers check with theirs
            probe_optimizer = optimizers.make(task.optimizer, [nn.Parameter(torch.zeros(1))],
                                              config.lr)
        except TorchGpuError:
            return
    make(task.scheduler, probe_optimizer, _named(config, task.scheduler))


# -- running ----------------------------------------------------------------------------

def step_hook(optimizer: Any, scheduler: Any, inner: StepHook | None) -> StepHook:
    """The loop's ``on_step`` (after every applied optimizer step): record the LR that
    step used, step ``scheduler`` (when there is one), then run ``inner``, so a
    checkpoint saved there holds the scheduler's state after the step, as the
    optimizer's."""
    # Read through the optimizer each time: loading a state replaces its param groups.
    groups = torch_optimizer(optimizer).param_groups
    if scheduler is None:
        def record(state: TrainState) -> None:
            state.step_lrs.append(float(groups[0]["lr"]))
            if inner is not None:
                inner(state)

        return record
    advance = scheduler.step

    def scheduled(state: TrainState) -> None:
        state.step_lrs.append(float(groups[0]["lr"]))
        advance()
        if inner is not None:
            inner(state)

    return scheduled
