"""torchgpu: PyTorch training that is correct and fast on whatever devices a machine has.

The public API is listed in ``__all__``. Names are resolved on first use, so
``import torchgpu`` stays cheap and never initialises CUDA.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it. Resolved lazily by __getattr__ (PEP 562).
_API: dict[str, str] = {
    "fit": "torchgpu.train.fit",
    "list_devices": "torchgpu.devices",
    "get_device": "torchgpu.devices",
    "select_devices": "torchgpu.devices",
    "set_visible_devices": "torchgpu.devices",
    "parse_visible_devices": "torchgpu.devices",
    "default_device": "torchgpu.devices",
    "DeviceInfo": "torchgpu.devices",
    "to_device": "torchgpu.transfer",
    "pin": "torchgpu.transfer",
    "Prefetcher": "torchgpu.transfer",
    "check_devices": "torchgpu.transfer",
    "Precision": "torchgpu.precision",
    "DistEnv": "torchgpu.distributed",
    "init_distributed": "torchgpu.distributed",
    "GradAccumulator": "torchgpu.accumulate",
    "apply_activation_checkpointing": "torchgpu.memory",
    "wrap_data_parallel": "torchgpu.parallel.data",
    "unwrap": "torchgpu.parallel.data",
    "split_model": "torchgpu.parallel.model",
    "Pipeline": "torchgpu.parallel.pipeline",
    "save_checkpoint": "torchgpu.checkpoint",
    "load_checkpoint": "torchgpu.checkpoint",
    "load_state_dict": "torchgpu.checkpoint",
    "estimate_memory": "torchgpu.estimate",
}

# Spelled out (not derived from _API) so linters and IDEs see the public names.
__all__ = [
    "DeviceInfo",
    "DistEnv",
    "GradAccumulator",
    "Pipeline",
    "Precision",
    "Prefetcher",
    "__version__",
    "apply_activation_checkpointing",
    "check_devices",
    "default_device",
    "estimate_memory",
    "fit",
    "get_device",
    "init_distributed",
    "list_devices",
    "load_checkpoint",
    "load_state_dict",
    "parse_visible_devices",
    "pin",
    "save_checkpoint",
    "select_devices",
    "set_visible_devices",
    "split_model",
    "to_device",
    "unwrap",
    "wrap_data_parallel",
]


def __getattr__(name: str) -> Any:
    module_name = _API.get(name)
    if module_name is None:
        raise AttributeError(f"module 'torchgpu' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from torchgpu.accumulate import GradAccumulator
    from torchgpu.checkpoint import load_checkpoint, load_state_dict, save_checkpoint
    from torchgpu.devices import (
        DeviceInfo,
        default_device,
        get_device,
        list_devices,
        parse_visible_devices,
        select_devices,
        set_visible_devices,
    )
    from torchgpu.distributed import DistEnv, init_distributed
    from torchgpu.estimate import estimate_memory
    from torchgpu.memory import apply_activation_checkpointing
    from torchgpu.parallel.data import unwrap, wrap_data_parallel
    from torchgpu.parallel.model import split_model
    from torchgpu.parallel.pipeline import Pipeline
    from torchgpu.precision import Precision
    from torchgpu.train.fit import fit
    from torchgpu.transfer import Prefetcher, check_devices, pin, to_device
