"""``torchgpu train --batch-size auto``: the largest micro-batch that fits, agreed by all ranks.

:func:`search_batch_size` grows, then bisects, a probe of one real forward and backward on
the run's device while holding Adam-sized extra memory (room for the optimizer); out of
memory means "does not fit", any other error is raised. The ranks agree on the minimum
after each probe, so all train with what the smallest GPU fits. Weights are not stepped;
buffers, gradients and the RNG are restored. The search is capped at the samples a rank
sees per epoch, the per-rank effective batch and ``MAX_AUTO_BATCH``. The effective batch
(samples per optimizer step: ``--effective-batch-size``, else the fixed-batch run's) never
changes; accumulation makes up what the micro-batch does not hold.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from torchgpu.errors import UsageError
from torchgpu.memory.batch_size_search import BatchSearchResult, find_batch_size, keep_effective
from torchgpu.memory.oom import Agree
from torchgpu.train.config import TrainConfig
from torchgpu.train.hooks.run_hooks import RunHooks
from torchgpu.train.task import Task

#: The largest micro-batch the search tries.
MAX_AUTO_BATCH = 65536
#: Adam keeps two tensors per parameter (exp_avg, exp_avg_sq).
OPTIMIZER_SLOTS = 2


@dataclass(frozen=True)
class AutoBatch:
    """The outcome: ``micro_batch`` per process and micro-step, ``accumulate`` micro-steps
    per optimizer step, the ``search`` behind it, and a one-line ``note`` for the log."""

    micro_batch: int
    accumulate: int
    search: BatchSearchResult
    note: str


def make_probe(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], Tensor],
    inputs: Any,
    targets: Any,
    device: torch.device,
    target_device: torch.device | None = None,
    autocast: Callable[[], Any] | None = None,
    optimizer_slots: int = OPTIMIZER_SLOTS,
) -> Callable[[int], None]:
    """``try_step(n)``: forward + backward of ``n`` samples (drawn cyclically from
    ``inputs``/``targets``, batches of any structure: a dict batch is its own target) on
    ``device``, labels on ``target_device``; gradients are dropped afterwards."""
    from torchgpu.data.batches import batch_rows, take_rows
    from torchgpu.transfer import to_device

    params = [p for p in model.parameters() if p.requires_grad]
    where = target_device if target_device is not None else device

    def try_step(n: int) -> None:
        index = torch.arange(n) % batch_rows(inputs)
        x = to_device(take_rows(inputs, index), device)
        y = x if targets is inputs else to_device(take_rows(targets, index), where)
        reserve = [torch.empty_like(p) for p in params for _ in range(optimizer_slots)]
        try:
            if autocast is not None:
                with autocast():
                    loss = loss_fn(model(x), y)
            else:
                loss = loss_fn(model(x), y)
            torch.autograd.backward(loss)
        finally:
            del reserve
            for p in params:
                p.grad = None

    return try_step


def search_batch_size(
    model: nn.Module,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    data: Task,
    device: torch.device,
    *,
    world_size: int = 1,
    start: int = 16,
    effective_batch: int | None = None,
    accumulate: int = 1,
    target_device: torch.device | None = None,
    autocast: Callable[[], Any] | None = None,
    agree: Agree | None = None,
    hooks: RunHooks | None = None,
) -> AutoBatch:
    """Find the micro-batch for ``model`` (already on ``device``; the unwrapped model
    under DDP) on ``data.train`` (``data``: the run's Task).
    Collective under a process group (every rank calls it). ``hooks``: the run's,
    whose :meth:`~torchgpu.train.hooks.run_hooks.RunHooks.wrap_probe` wraps each probe.

    ``effective_batch`` (all processes) must be a multiple of ``world_size``.
    Raises UsageError for an effective batch that does not split over the processes,
    :class:`~torchgpu.errors.OutOfMemoryBackoffError` when one sample does not fit.
    """
    rows = data.train_rows
    per_rank_rows = math.ceil(rows / world_size)
    per_rank_effective: int | None = None
    if effective_batch is not None:
        if effective_batch % world_size:
            raise UsageError(
                f"--effective-batch-size {effective_batch} does not split over {world_size} "
                f"processes: use a multiple of {world_size}, e.g. "
                f"{max(world_size, effective_batch - effective_batch % world_size)}."
            )
        per_rank_effective = effective_batch // world_size
    cap = min(MAX_AUTO_BATCH, per_rank_rows, per_rank_effective or MAX_AUTO_BATCH)
    inputs, targets = data.sample(min(rows, cap))  # every row a probe of <= cap can use
    probe = make_probe(model, loss_fn, inputs, targets, device, target_device, autocast)
    if hooks is not None:
        probe = hooks.wrap_probe(probe)
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    was_training = model.training
    cuda = [d.index or 0 for d in {device, target_device or device} if d.type == "cuda"]
    model.train()
    try:
        with torch.random.fork_rng(devices=cuda):
            result = find_batch_size(probe, start=max(1, min(start, cap)), max_size=cap,
                                     agree=agree)
    finally:
        model.train(was_training)
        with torch.no_grad():
            for k, v in model.named_buffers():
                if k in buffers:
                    v.copy_(buffers[k])
    if per_rank_effective is not None:
        micro, steps = keep_effective(per_rank_effective, result.size)
    else:
        micro, steps = result.size, accumulate
    note = (f"--batch-size auto: {result.describe()}; training with micro-batch {micro} x "
            f"{steps} accumulation x {world_size} process(es) = {micro * steps * world_size} "
            "samples per optimizer step")
    return AutoBatch(micro, steps, result, note)


def fixed_effective(config: TrainConfig, ranks: int) -> TrainConfig:
    """``config`` with ``--effective-batch-size E`` and a fixed ``--batch-size B`` turned
    into the accumulation that keeps ``E`` samples per optimizer step over ``ranks``
    data-parallel processes (``effective_batch_size`` then None: it is resolved). Unchanged
    without E or with ``--batch-size auto`` (the search keeps E). UsageError when ``E``
    is not a multiple of ``B x ranks``."""
    effective, batch = config.effective_batch_size, config.batch_size
    if effective is None or config.auto_batch_size or batch is None:
        return config
    per_micro = batch * ranks
    if effective % per_micro:
        lower = max(per_micro, effective // per_micro * per_micro)
        procs = f" x {ranks} processes" if ranks > 1 else ""
        raise UsageError(
            f"--effective-batch-size {effective} is not a multiple of --batch-size {batch}"
            f"{procs} = {per_micro} samples per micro-step, so no accumulation keeps it: "
            f"use --effective-batch-size {lower} or {lower + per_micro}, a --batch-size "
            f"that divides {effective // ranks if effective % ranks == 0 else effective}, or "
            "--batch-size auto.")
    return dataclasses.replace(config, accumulate=effective // per_micro,
                               effective_batch_size=None)


def batch_line(config: TrainConfig, ranks: int) -> str:
    """The run's batch in one line: per-process micro-batch, accumulation, data-parallel
    processes and the global batch (samples per optimizer step)."""
    assert config.batch_size is not None
    return (f"batch: {config.batch_size} samples per process and micro-batch x "
            f"{config.accumulate} accumulation x {ranks} process(es) = "
            f"{config.batch_size * config.accumulate * ranks} samples per optimizer step "
            "(global batch)")


def apply_auto_batch(
    config: TrainConfig,
    model: nn.Module,
    data: Task,
    device: torch.device,
    world_size: int,
    hooks: RunHooks | None = None,
) -> tuple[TrainConfig, str]:
    """``config`` with the searched ``batch_size``/``accumulate`` (unchanged without
    ``--batch-size auto``) and the note to log. ``model`` is the wrapped training model;
    ``hooks``: the run's (they may wrap the search's probe)."""
    if not config.auto_batch_size:
        return config, ""
    assert config.batch_size is not None  # resolved: the default, or --config's value
    effective = config.effective_batch_size
    if effective is None:  # keep the fixed-batch run's step: auto only cuts it to fit
        effective = config.batch_size * config.accumulate * world_size
    from torchgpu.parallel.data import unwrap
    from torchgpu.parallel.model import placed_output_device
    from torchgpu.precision import Precision

    target = placed_output_device(model)
    # Probe the unwrapped model: DDP's all-reduce would hang when one rank runs out of memory.
    probe_model = model if target is not None else unwrap(model)
    precision = Precision(config.precision, device)
    found = search_batch_size(
        probe_model, data.loss, data, device, world_size=world_size,
        start=config.batch_size, effective_batch=effective,
        accumulate=config.accumulate, target_device=target,
        autocast=precision.autocast if precision.dtype is not None else None,
        hooks=hooks,
    )
    why = ("--effective-batch-size" if config.effective_batch_size is not None else
           f"batch {config.batch_size} x {config.accumulate} accumulation x {world_size} "
           "process(es), as without auto; --effective-batch-size E sets another")
    return dataclasses.replace(config, batch_size=found.micro_batch,
                               accumulate=found.accumulate), f"{found.note} ({why})"
