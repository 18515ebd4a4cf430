"""``torchgpu train --strategy auto``: ask the planner, on this machine's devices.

A model that fits on one device keeps the plain rule: ``ddp`` with several processes, else
``single``. Otherwise the planner's plan is applied through the same settings ``torchgpu
plan`` prints (strategy, micro-batch, accumulation, activation checkpointing, devices), and
the decision is logged as one line (``--strategy auto: ...``). Planning costs about a
second, so it is skipped when :func:`step_bound_bytes` shows the step is below the size
for which the planner always answers ``single``. ``--device cpu`` plans for the CPU,
``cuda:N`` for that GPU, ``auto``/``cuda`` for every visible GPU (else the CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchgpu.errors import UsageError
from torchgpu.train import strategies
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_checks import validate
from torchgpu.train.recipe.optimizers import planned_name
from torchgpu.train.task import Task

#: Activations + backward temporaries per saved byte in the cheap bound.
BOUND_FACTOR = 3
#: Bytes per parameter byte for weights, gradients and Adam's two states.
STATE_FACTOR = 4


@dataclass(frozen=True)
class AutoDecision:
    """The config to run (concrete ``strategy``), the log line, and the plan (None when
    planning was skipped). ``bound_bytes``: the cheap bound that decided whether to plan."""

    config: TrainConfig
    note: str
    plan: Any | None
    bound_bytes: int


def step_bound_bytes(model: nn.Module, sample: Any, batch: int) -> int:
    """A cheap, generous bound of one training step's memory at ``batch`` samples.

    ``sample`` is one batch of inputs of any structure (a tensor; a dict, called
    ``model(**sample)``; a tuple/list, ``model(*sample)``), at least one sample; only the
    first is used.
    """
    from torchgpu.data.batches import first_rows
    from torchgpu.memory.saved_tensors import saved_tensor_bytes

    one = first_rows(sample, 1)

    def forward() -> Any:
        if isinstance(one, Mapping):
            return model(**one)
        if isinstance(one, tuple | list):
            return model(*one)
        return model(one)

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    was_training = model.training
    model.eval()  # so the forward updates nothing (BatchNorm statistics)
    try:
        saved = saved_tensor_bytes(forward)
    finally:
        model.train(was_training)
    return STATE_FACTOR * params + buffers + BOUND_FACTOR * saved * batch


def planner_devices(config: TrainConfig) -> str:
    """The planner's device spec for ``config.device``."""
    if config.device in ("cpu", "mps") or config.device.startswith("cuda:"):
        return config.device
    if config.device.isdigit():
        return f"cuda:{config.device}"
    return "auto"


def _planner_precision(precision: str) -> str:
    return "fp32" if precision == "auto" else precision  # auto: plan for the larger one


def decide_strategy(
    config: TrainConfig,
    world_size: int,
    data: Task,
    *,
    launching: bool = False,
    plan_fn: Callable[..., Any] | None = None,
    small_step_bytes: int | None = None,
    model: nn.Module | None = None,
) -> AutoDecision:
    """Resolve ``--strategy auto`` for ``config`` (a resolved config) with ``world_size``
    processes. ``launching``: the caller can still start ``plan.nproc`` processes (the
    CLI before torchrun); otherwise a plan that needs more processes than exist raises
    UsageError with the plan's command. ``data``: the run's Task (its samples, and the
    optimizer whose state the planner counts). ``plan_fn`` replaces the planner and
    ``small_step_bytes`` the skip threshold (tests). ``model``: the run's model, already
    built (measured in eval mode, left as it was); default: ``data.build_model()``.
    """
    from torchgpu.planning.decide import SMALL_STEP_BYTES
    from torchgpu.sizes import format_bytes
    assert config.batch_size is not None
    keep = "ddp" if world_size > 1 else "single"
    if config.strategy != "auto":
        return AutoDecision(config, "", None, 0)
    if model is None:
        model = data.build_model()
    inputs, _ = data.sample(1)
    batch = config.batch_size * config.accumulate * world_size  # samples per step
    bound = step_bound_bytes(model, inputs, config.batch_size)
    small = SMALL_STEP_BYTES if small_step_bytes is None else small_step_bytes
    if bound <= small:
        return AutoDecision(
            dataclasses.replace(config, strategy=keep),
            f"--strategy auto: {keep} (a one-sample probe bounds the step at "
            f"{format_bytes(bound)}, within {format_bytes(small)}: planner skipped)",
            None, bound)
    if plan_fn is None:
        from torchgpu.planning.planner import plan_for_training

        plan_fn = plan_for_training
    sample: Any
    if isinstance(inputs, torch.Tensor):
        sample = torch.empty((config.batch_size, *inputs.shape[1:]), dtype=inputs.dtype,
                             device="meta")
    else:  # a structured batch (dicts of token ids...): real rows, the estimator fakes them
        sample = data.sample(config.batch_size)[0]
    # config.example is set (resolved) only for a built-in example: it names the run in
    # the plan's command line.
    plan = plan_fn(model, sample, batch_size=batch, devices=planner_devices(config),
                   optimizer=planned_name(data.optimizer),
                   precision=_planner_precision(config.precision), example=config.example)
    single = next((c for c in plan.candidates if c.label == "single"), None)
    if single is not None and single.fits:
        return AutoDecision(
            dataclasses.replace(config, strategy=keep),
            f"--strategy auto: {keep} (the planner: one device fits the step, "
            f"{format_bytes(single.peak_bytes)} of {format_bytes(max(single.usable_bytes))} "
            f"usable; its pick: {plan.strategy})", plan, bound)
    chosen = _apply(config, plan, world_size, launching)
    validate(chosen)
    return AutoDecision(chosen, f"--strategy auto: {plan.strategy} (the planner: {plan.reason})",
                        plan, bound)


def _apply(config: TrainConfig, plan: Any, world_size: int, launching: bool) -> TrainConfig:
    """``config`` running ``plan``: the settings of ``plan.settings``
    (:func:`torchgpu.planning.commands.train_settings`, the same translation that writes
    ``torchgpu plan``'s command), less ``nproc`` when this process cannot start others."""
    changes: dict[str, Any] = plan.settings.config_changes()
    planned = strategies.get(plan.strategy)
    if planned.processes == "several":  # ddp, fsdp: one process per device
        if plan.nproc > world_size and not launching:
            raise UsageError(
                f"--strategy auto: the model does not fit on one device and the plan needs "
                f"{plan.nproc} processes but {world_size} run: start them with "
                f"`{plan.command or 'torchgpu train --nproc ' + str(plan.nproc)}`."
            )
        if not launching:
            changes.pop("nproc", None)  # the processes exist already (torchrun workers)
    elif "devices" in planned.features.flags and world_size > 1:  # model/pipeline
        raise UsageError(
            f"--strategy auto: the plan is {plan.strategy} over {', '.join(plan.devices)} in "
            f"one process, but {world_size} processes run: drop --nproc."
        )
    return dataclasses.replace(config, **changes)
