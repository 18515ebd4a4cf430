"""The planner's memory estimate next to the measured peak, in ``summary.json``.

Every run records ``peak_memory_bytes`` per device and, on CUDA, the estimate beside it.
The estimate is the planner's row when ``--strategy auto`` planned (free), else, on CUDA
or with ``--estimate-memory``, ``torchgpu.estimate_memory`` after training on a
:func:`meta_twin` of the trained model (about a second, no weight copied); otherwise
``memory_estimate`` says why there is none. The entry says what the numbers are: on CUDA
the peak is ``max_memory_allocated``, what the estimate models (the CUDA context is in
neither); on CPU it is the process's peak resident memory (interpreter, libraries, data),
no check of the estimate, so ``comparable`` is false there.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchgpu.train import strategies
from torchgpu.train.config import TrainConfig

if TYPE_CHECKING:
    from torchgpu.train.task import Task

NOT_ASKED = ("not estimated on CPU (its peak is the process's resident memory, Python and "
             "data included): pass --estimate-memory (about a second) to record the "
             "planner's estimate beside it anyway")

#: What ``peak_memory_bytes`` is, per device type, and whether the estimate models it.
MEASURED: dict[str, tuple[str, bool]] = {
    "cuda": ("peak_memory_bytes is torch.cuda.max_memory_allocated: the tensors torch "
             "allocated on the device (the CUDA context, ~0.3-0.5 GiB, is in neither "
             "number), which estimated_peak_bytes models", True),
    "cpu": ("peak_memory_bytes is the process's peak resident memory (the Python "
            "interpreter, torch's libraries ~0.4 GiB, the data set, allocator caches), "
            "not the training tensors estimated_peak_bytes counts (weights, gradients, "
            "optimizer state, activations): the two are not comparable on CPU", False),
}


def _measured(devices: Sequence[str]) -> dict[str, Any]:
    kinds = {d.split(":")[0] for d in devices}
    kind = "cuda" if kinds == {"cuda"} else "cpu" if kinds == {"cpu"} else None
    if kind is None:
        return {"measured": f"peak_memory_bytes is measured per device type ({sorted(kinds)})",
                "comparable": "cpu" not in kinds}
    text, comparable = MEASURED[kind]
    return {"measured": text, "comparable": comparable}


def _plain_class(module: nn.Module) -> type:
    # fully_shard swaps a module's class for a subclass of FSDPModule (which refuses
    # deepcopy); the twin gets the class the model was written with.
    cls = type(module)
    if "torch.distributed.fsdp" in sys.modules:
        from torch.distributed.fsdp import FSDPModule

        if isinstance(module, FSDPModule):
            return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
    return cls


def meta_twin(model: nn.Module) -> nn.Module:
    """The trained ``model``'s plain structure with every parameter and buffer a meta
    tensor of the same (full, unsharded) shape and dtype, ties kept: what
    :func:`torchgpu.estimate_memory` reads, built without calling the model factory
    again and without copying a weight.

    Wrappers (DDP, ``torch.compile``) are peeled; FSDP2's sharding (class and state)
    and every module hook are left behind (forward hooks of back-off, profiling or FSDP
    would run in the estimator's fake forward), and activation checkpointing is removed:
    the estimator models it from the run's setting. Other attributes are shared with
    the trained model, which the estimator only reads."""
    from torchgpu.memory.activation_checkpointing import remove_activation_checkpointing
    from torchgpu.parallel.data import unwrap

    tensors: dict[int, torch.Tensor] = {}
    modules: dict[int, nn.Module] = {}

    def meta(t: torch.Tensor | None, parameter: bool) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in tensors:  # tied weights stay tied
            empty = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")
            tensors[id(t)] = nn.Parameter(empty, t.requires_grad) if parameter else empty
        return tensors[id(t)]

    def twin(module: nn.Module | None) -> nn.Module | None:
        if module is None:
            return None
        if id(module) not in modules:  # a module used twice stays one module
            copy: nn.Module = object.__new__(_plain_class(module))
            modules[id(module)] = copy
            state = {k: v for k, v in vars(module).items()
                     if not k.startswith("__composable")}  # fully_shard's state
            for key, value in state.items():
                if isinstance(value, dict) and "_hooks" in key:
                    state[key] = OrderedDict()
            state["_parameters"] = {n: meta(p, True) for n, p in module._parameters.items()}
            state["_buffers"] = {n: meta(b, False) for n, b in module._buffers.items()}
            state["_non_persistent_buffers_set"] = set(module._non_persistent_buffers_set)
            state["_modules"] = {n: twin(c) for n, c in module._modules.items()}
            copy.__dict__.update(state)
        return modules[id(module)]

    plain = twin(unwrap(model))
    assert plain is not None
    return remove_activation_checkpointing(plain)


def from_plan(plan: Any, mode: str) -> dict[str, Any] | None:
    """The planner's row for strategy ``mode`` (its pick when that is ``mode``)."""
    rows = [plan.chosen, *plan.candidates]
    row = next((c for c in rows if c.strategy == mode and c.applicable), None)
    if row is None:
        return None
    return {"source": "planner", "strategy": row.label, "micro_batch": row.micro_batch,
            "per_device_bytes": list(row.per_device_bytes), "devices": list(row.devices)}


def from_estimator(config: TrainConfig, task: Task, mode: str, world: int,
                   devices: Sequence[str], model: nn.Module) -> dict[str, Any]:
    """:func:`torchgpu.estimate_memory` for the run's settings on a :func:`meta_twin` of
    the trained ``model`` (``devices``: the device of each rank, or the one device of a
    one-process run)."""
    from torchgpu.memory.estimate import estimate_memory

    # The strategy that ran -> estimate_memory's name for it (declared by the strategy;
    # dp, one process driving every GPU through nn.DataParallel, has no estimator model).
    strategy = strategies.get(mode).features.estimate
    if strategy is None:
        return {"source": None, "note": f"not estimated: the estimator has no model of {mode}"}
    assert config.batch_size is not None
    options: dict[str, Any] = {}
    if strategy in ("split", "pipeline") and (config.devices or world > 1):
        # --devices, or one stage per process (the pipeline with --nproc): each rank's own
        options["devices"] = ([d.strip() for d in config.devices.split(",")]
                              if config.devices else list(devices))
        if config.balance and config.balance.replace(",", "").isdigit():
            options["balance"] = [int(b) for b in config.balance.split(",")]
        if strategy == "pipeline" and isinstance(config.chunks, int):
            options["chunks"] = config.chunks
    elif strategy in ("ddp", "fsdp"):
        # each rank's own device (cpu on a CPU run), not the estimator's default cuda:N
        ranks = list(devices)
        options["devices"] = ranks if len(ranks) == world else [ranks[0]] * world
    else:
        options["devices"] = [devices[0]]
    sample = task.sample(config.batch_size)[0]
    precision = "fp32" if config.precision == "auto" else config.precision
    estimate = estimate_memory(meta_twin(model), sample, optimizer="adam",
                               precision=precision, strategy=strategy,
                               activation_checkpointing=bool(config.activation_checkpointing),
                               **options)
    names = [d.device for d in estimate.devices]
    return {"source": "estimate_memory", "strategy": strategy,
            "micro_batch": config.batch_size,
            "per_device_bytes": [d.peak_bytes for d in estimate.devices],
            "devices": names, **_measured(names)}


def memory_estimate(config: TrainConfig, plan: Any | None, task: Task, mode: str,
                    world: int, device: str = "cpu", *, model: nn.Module | None = None,
                    devices: Sequence[str] | None = None) -> dict[str, Any]:
    """The ``memory_estimate`` entry of the summary (see the module docstring).
    ``model``: the trained model (estimated through its :func:`meta_twin`);
    ``devices``: each rank's device (default: ``device`` for every rank)."""
    if plan is not None:
        found = from_plan(plan, mode)
        # The planner's row is for the micro-batch it planned; after --batch-size auto the
        # run trained another one (seen on an H200: 8 planned, 3000 trained), so the
        # estimate is made again for the batch the peak was measured at.
        if found is not None and (config.batch_size is None
                                  or found["micro_batch"] in (None, config.batch_size)):
            return {**found, **_measured(found["devices"])}
    if not (config.estimate_memory or device.startswith("cuda")):
        return {"source": None, "note": NOT_ASKED}
    if model is None:
        return {"source": None, "note": "estimate_memory failed: no trained model was given"}
    try:
        return from_estimator(config, task, mode, world, list(devices or [device]), model)
    except Exception as error:  # an estimate is evidence, never a reason to fail the run
        return {"source": None, "note": f"estimate_memory failed: {error}"}


def annotate_devices(devices: list[dict[str, Any]], entry: dict[str, Any]) -> None:
    """Add ``estimated_peak_bytes`` to each summary device entry: a rank's own row (ddp,
    fsdp: every rank holds the same), or the one stage of a one-process split."""
    estimates = entry.get("per_device_bytes") or []
    if not estimates:
        return
    for i, device in enumerate(devices):
        device["estimated_peak_bytes"] = estimates[i] if i < len(estimates) else estimates[0]
    if len(estimates) > len(devices):  # one process over several stage devices
        devices[0]["estimated_peak_bytes"] = max(estimates)
