"""The planner's entry points: a Plan from a Footprint (pure), or from a model (measured).

``plan_for_training`` is what ``torchgpu train --strategy auto`` calls::

    plan = plan_for_training(model, sample_batch, batch_size=256, devices="auto",
                             optimizer="adam", precision="fp32", example="resnet50")
    plan.strategy, plan.micro_batch, plan.accumulate, plan.activation_checkpointing
    plan.devices, plan.nproc, plan.chunks, plan.balance, plan.command, plan.reason
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.planning.candidates import COSTS, Costs, all_candidates
from torchgpu.planning.commands import python_snippet, train_command, train_settings
from torchgpu.planning.decide import Plan, choose
from torchgpu.planning.footprint import Footprint
from torchgpu.planning.targets import HEADROOM, DeviceTarget, parse_devices
from torchgpu.planning.workload import Workload


def plan_from_footprint(
    footprint: Footprint,
    targets: Sequence[DeviceTarget],
    workload: Workload,
    costs: Costs = COSTS,
) -> Plan:
    """Price every strategy for ``workload.batch_size`` samples per step on ``targets``
    and choose one (:func:`torchgpu.planning.decide.choose`). Pure: no model, no device.

    Raises :class:`PlanError` with the numbers when nothing fits, :class:`ConfigError`
    for a batch size below 1 or no devices.
    """
    if workload.batch_size < 1:
        raise ConfigError(
            f"batch size {workload.batch_size} cannot be planned: it must be >= 1 "
            "(samples per optimizer step), e.g. --batch-size 32"
        )
    if not targets:
        raise ConfigError("no devices to plan for: pass --devices auto, 4x80GiB or cuda:0,cuda:1")
    candidates = all_candidates(footprint, targets, workload.batch_size, costs)
    chosen, reason = choose(candidates, footprint, targets, precision=workload.precision)
    return Plan(
        strategy=chosen.strategy,
        micro_batch=chosen.micro_batch,
        accumulate=chosen.accumulate,
        activation_checkpointing=chosen.checkpointing,
        devices=chosen.devices,
        nproc=len(chosen.devices) if chosen.strategy in ("ddp", "fsdp") else 1,
        chunks=chosen.chunks,
        balance=chosen.balance,
        batch_size=workload.batch_size,
        effective_batch=chosen.effective_batch,
        reason=reason,
        settings=train_settings(chosen, targets),
        command=train_command(chosen, workload, targets),
        python=python_snippet(chosen, workload, targets),
        chosen=chosen,
        candidates=tuple(candidates),
        targets=tuple(targets),
        footprint=footprint,
    )


def plan_for_training(
    model: nn.Module | Callable[[], nn.Module],
    sample_batch: torch.Tensor | tuple[torch.Tensor, ...],
    batch_size: int,
    devices: str | Sequence[DeviceTarget] = "auto",
    optimizer: str = "adam",
    precision: str = "fp32",
    *,
    example: str | None = None,
    model_spec: str | None = None,
    headroom: float = HEADROOM,
) -> Plan:
    """Measure ``model`` with ``sample_batch`` (inputs; any batch size, scaled to
    ``batch_size``) and plan training at ``batch_size`` samples per optimizer step on
    ``devices`` (a spec string for :func:`parse_devices`, or targets).

    ``model`` may be a module or a zero-argument factory; it is only measured (on meta /
    fake tensors where the estimator can), never trained or moved. ``example`` or
    ``model_spec`` name the model in the command (``--example``; a custom model gets no
    command but Python, see :attr:`Plan.command` and :attr:`Plan.python`). Raises
    :class:`PlanError` when nothing fits, UsageError for a bad device spec.
    """
    from torchgpu.planning.measure import measure_footprint

    targets = (
        parse_devices(devices, headroom=headroom) if isinstance(devices, str) else list(devices)
    )
    module = model if isinstance(model, nn.Module) else model()
    footprint = measure_footprint(module, sample_batch, optimizer=optimizer, precision=precision)
    workload = Workload(
        batch_size=batch_size,
        example=example,
        model=model_spec,
        precision=precision,
        optimizer=optimizer,
    )
    return plan_from_footprint(footprint, targets, workload)
