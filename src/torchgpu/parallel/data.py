"""Data parallelism: one call to wrap a model, one call to get the plain model back.

- ``dp``: ``nn.DataParallel`` (the seeds' way): one process drives every visible GPU,
  splitting each batch along dim 0. On a machine without CUDA GPUs it falls back to
  the unwrapped model on one device and says so with a
  :class:`DataParallelFallbackWarning`.
- ``ddp``: ``DistributedDataParallel``, one process per device (torchrun); the process
  group must exist (:func:`torchgpu.distributed.init_distributed`).
- ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``): each child block is sharded
  as its own unit (blocks that share a tied parameter together), then the root.

:func:`unwrap` peels DataParallel, DDP, FSDP1 and ``torch.compile`` wrappers, nested in any
order, so checkpoints hold the plain model's canonical keys.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchgpu.devices.cuda_status import cuda_device_count
from torchgpu.errors import ConfigError

MODES: tuple[str, ...] = ("dp", "ddp", "fsdp")


class DataParallelFallbackWarning(UserWarning):
    """``mode="dp"`` was asked for on a machine without CUDA GPUs: one device is used."""


def _is_compiled(module: nn.Module) -> bool:
    # torch.compile's OptimizedModule; matched by module path so that unwrap does not
    # import torch._dynamo (slow) just to check.
    return type(module).__module__.startswith("torch._dynamo") and hasattr(module, "_orig_mod")


def _fsdp1_class() -> type | None:
    # FSDP1 wrappers can only exist if their module was imported.
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel


def _inner(module: nn.Module) -> nn.Module | None:
    """The module one wrapper layer down, or None when ``module`` is not a wrapper."""
    if isinstance(module, (nn.DataParallel, DistributedDataParallel)):
        inner = module.module
    elif _is_compiled(module):
        inner = module._orig_mod
    else:
        fsdp1 = _fsdp1_class()
        if fsdp1 is None or not isinstance(module, fsdp1):
            return None
        inner = module.module
    return inner if isinstance(inner, nn.Module) else None


def wrapper_chain(model: nn.Module) -> Iterator[nn.Module]:
    """``model``, then each module it wraps, down to the plain model (outermost first)."""
    current: nn.Module | None = model
    while current is not None:
        yield current
        current = _inner(current)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DataParallel / DDP / FSDP1 / ``torch.compile`` wrappers,
    nested in any order (e.g. ``compile(DDP(m))`` -> ``m``). A model sharded with FSDP2
    ``fully_shard`` is its own plain model (FSDP2 does not wrap) and is returned as is."""
    return list(wrapper_chain(model))[-1]


def find_ddp(model: nn.Module) -> DistributedDataParallel | None:
    """The DistributedDataParallel layer in ``model``'s wrapper chain, if any."""
    for layer in wrapper_chain(model):
        if isinstance(layer, DistributedDataParallel):
            return layer
    return None


def wrap_data_parallel(
    model: nn.Module,
    mode: str,
    device: torch.device | str | None = None,
    batch_size: int | None = None,
    **kw: Any,
) -> nn.Module:
    """Wrap ``model`` for data-parallel training.

    ``mode``: ``"dp"`` | ``"ddp"`` | ``"fsdp"``. ``device``: where the model lives
    (default: where its parameters are). ``batch_size``: the per-step batch, checked
    against the GPU count for ``dp``. Extra keywords go to the wrapper
    (``nn.DataParallel``, ``DistributedDataParallel`` or ``fully_shard``).

    Returns the wrapped model (``dp``/``ddp``), the sharded model itself (``fsdp``), or
    for ``dp`` without GPUs the model unchanged, with a DataParallelFallbackWarning.
    Raises ConfigError for an unknown mode, a batch smaller than the GPU count, or
    ``ddp``/``fsdp`` without an initialised process group.
    """
    if not isinstance(mode, str) or mode.lower() not in MODES:
        raise ConfigError(
            f"unknown data-parallel mode {mode!r}: use one of {', '.join(MODES)} "
            "(dp = nn.DataParallel in one process, ddp = DistributedDataParallel under "
            "torchrun, fsdp = FSDP2 fully_shard under torchrun)."
        )
    mode = mode.lower()
    dev = torch.device(device) if device is not None else None
    if mode == "dp":
        return _wrap_dp(model, dev, batch_size, **kw)
    _require_group(mode)
    if mode == "ddp":
        return _wrap_ddp(model, dev, **kw)
    return _wrap_fsdp(model, dev, **kw)


def _wrap_dp(
    model: nn.Module, device: torch.device | None, batch_size: int | None, **kw: Any
) -> nn.Module:
    on_cuda = device is None or device.type == "cuda"
    count = cuda_device_count() if on_cuda and torch.cuda.is_available() else 0
    if count == 0:
        where = device if device is not None else torch.device("cpu")
        reason = (
            f"device {where} was chosen" if device is not None and device.type != "cuda"
            else "no CUDA GPU is visible"
        )
        warnings.warn(
            f"DataParallel needs CUDA GPUs and {reason}: falling back to one device "
            f"({where}); the model runs unwrapped, with the same results as a "
            "single-device run.",
            DataParallelFallbackWarning,
            stacklevel=3,
        )
        if device is not None:
            model.to(where)  # in place; a model's own .to() override may return nothing
        return model
    device_ids = list(kw.pop("device_ids", None) or range(count))
    if device is not None and device.index is not None and device.index in device_ids:
        # the requested GPU holds the parameters and gathers the outputs
        device_ids.remove(device.index)
        device_ids.insert(0, device.index)
    if batch_size is not None and batch_size < len(device_ids):
        raise ConfigError(
            f"batch size {batch_size} is smaller than the {len(device_ids)} GPUs "
            f"DataParallel splits each batch over (device_ids={device_ids}): use a batch "
            f"size >= {len(device_ids)}, or fewer GPUs (--gpus / CUDA_VISIBLE_DEVICES)."
        )
    first = torch.device("cuda", int(device_ids[0]))
    # DataParallel requires the parameters on device_ids[0] before the first forward.
    model.to(first)
    return nn.DataParallel(model, device_ids=device_ids, **kw)


def _require_group(mode: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigError(
            f"mode {mode!r} needs an initialised process group and there is none: launch "
            "one process per device with torchrun (torchgpu launch --nproc N SCRIPT, or "
            "torchgpu train --nproc N) and call torchgpu.init_distributed() before "
            "wrapping; for a single process use mode 'dp' or no wrapper."
        )


def _model_device(model: nn.Module, device: torch.device | None) -> torch.device:
    if device is not None:
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return device
    for tensor in model.parameters():
        return tensor.device
    return torch.device("cpu")


def _wrap_ddp(model: nn.Module, device: torch.device | None, **kw: Any) -> nn.Module:
    dev = _model_device(model, device)
    model.to(dev)
    if dev.type == "cuda":
        kw.setdefault("device_ids", [dev.index])
        kw.setdefault("output_device", dev.index)
    # On CPU, DDP must get device_ids=None (it refuses a CPU id list).
    return DistributedDataParallel(model, **kw)


def _sequential_view(model: nn.Module) -> nn.Module:
    view: Callable[[], nn.Module] = getattr(model, "as_sequential")  # noqa: B009
    return view()


def _candidate_units(model: nn.Module) -> list[nn.Module]:
    """The blocks that could be sharded one by one before the root: the sequential view's
    children when the model offers one, else the direct children; parameter-free ones
    skipped."""
    if isinstance(model, nn.Sequential):
        children = list(model.children())
    elif callable(getattr(model, "as_sequential", None)):
        children = list(_sequential_view(model).children())
    else:
        children = list(model.children())
    # A sequential view may build new containers (e.g. a head of pool+fc) that the
    # model's own forward never calls: sharding those would leave their parameters
    # un-gathered, so only real submodules become units; the root covers the rest.
    # ModuleList/ModuleDict have no forward, so fully_shard cannot take them either.
    members = {id(m) for m in model.modules()}
    return [
        c for c in children
        if id(c) in members
        and not isinstance(c, (nn.ModuleList, nn.ModuleDict))
        and any(True for _ in c.parameters())
    ]


def _root_params(model: nn.Module, units: list[nn.Module]) -> set[int]:
    """Ids of the parameters the root's ``fully_shard`` manages when ``units`` are
    sharded first: those of every module reached from the root without entering a unit
    (FSDP2's own walk stops at a module that already has a state)."""
    unit_ids = {id(u) for u in units}
    seen: set[int] = set()
    params: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        params.update(id(p) for p in module.parameters(recurse=False))
        stack.extend(c for c in module.children() if id(c) not in unit_ids)
    return params


def shard_units(model: nn.Module) -> list[list[nn.Module]]:
    """The FSDP units ``wrap_data_parallel(mode="fsdp")`` shards before the root, each a
    list of modules sharded together (``fully_shard(unit)``), in the model's order.

    Every parameter belongs to exactly one unit or to the root, as FSDP2 requires: blocks
    that share a parameter (an LM head tied to the token embedding) form one unit, and a
    block sharing a parameter with what the root keeps (a parameter on the root itself, a
    ``ModuleList``'s blocks) is left to the root.
    """
    candidates = _candidate_units(model)
    params = [{id(p) for p in c.parameters()} for c in candidates]
    # union the candidates that share a parameter
    group = list(range(len(candidates)))

    def find(i: int) -> int:
        while group[i] != i:
            group[i] = group[group[i]]
            i = group[i]
        return i

    for i in range(len(candidates)):
        for j in range(i):
            if params[i] & params[j]:
                group[find(i)] = find(j)
    units: dict[int, list[int]] = {}
    for i in range(len(candidates)):
        units.setdefault(find(i), []).append(i)
    kept = list(units.values())
    while True:  # a unit left to the root may tie another unit to the root in turn
        members = [candidates[i] for unit in kept for i in unit]
        root = _root_params(model, members)
        left = [u for u in kept if any(params[i] & root for i in u)]
        if not left:
            break
        kept = [u for u in kept if u not in left]
    return [[candidates[i] for i in unit] for unit in kept]


def _wrap_fsdp(model: nn.Module, device: torch.device | None, **kw: Any) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dev = _model_device(model, device)
    model.to(dev)
    if "mesh" not in kw:
        # fully_shard's default mesh is CUDA whenever CUDA exists, even for a CPU model
        # on gloo; build the mesh for the model's own device type.
        kw["mesh"] = init_device_mesh(dev.type, (dist.get_world_size(),))
    for unit in shard_units(model):
        # a list is one FSDP group: tied parameters must be gathered and reduced once
        fully_shard(unit if len(unit) > 1 else unit[0], **kw)
    fully_shard(model, **kw)
    return model


def retie(state: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state`` with every tied parameter of ``model`` (one Parameter under several
    names) pointing at one tensor again, in place; returns ``state``.

    A full state dict gathered from an FSDP2 model (``get_model_state_dict`` with
    ``full_state_dict=True``) gathers each name on its own, so a tied LM head comes back
    as a copy of the embedding: re-tied, the checkpoint stores it once, as for the other
    strategies. A tied name missing from ``state`` is added, as ``state_dict()`` has it."""
    first: dict[int, str] = {}
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        source = first.setdefault(id(param), name)
        if source != name and source in state:  # (also a name the gather left out)
            state[name] = state[source]
    return state
