"""What devices exist and which one to use.

One concept per module:

- :mod:`~torchgpu.devices.nvml`: the optional NVML reader (names, memory, processes);
- :mod:`~torchgpu.devices.visible`: CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER, as the
  driver reads them, and torch's numbering of NVML's GPUs;
- :mod:`~torchgpu.devices.torch_build`: torch's version and CUDA/ROCm build, read
  without importing torch; whether MPS exists;
- :mod:`~torchgpu.devices.cuda_status`: whether CUDA is initialised, usable, and how
  many GPUs torch counts, never initialising CUDA;
- :mod:`~torchgpu.devices.host`: the CPU's name, cores and RAM;
- :mod:`~torchgpu.devices.info` and :mod:`~torchgpu.devices.listing`:
  :class:`DeviceInfo` and :func:`list_devices`;
- :mod:`~torchgpu.devices.selection`: :func:`select_devices`;
- :mod:`~torchgpu.devices.set_visible`: :func:`set_visible_devices`;
- :mod:`~torchgpu.devices.spec`: :func:`get_device`, :func:`placement_device`,
  :func:`default_device`.

The names below are resolved on first use (PEP 562), so ``from torchgpu.devices import
list_devices`` loads only what listing needs: with NVML available, not torch. Nothing
here initialises CUDA unless asked (``init_cuda=True``) or already done.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> module that defines it.
_EXPORTS: dict[str, str] = {
    "DeviceInfo": "torchgpu.devices.info",
    "GpuProcess": "torchgpu.devices.nvml",
    "VisibleDevices": "torchgpu.devices.visible",
    "parse_visible_devices": "torchgpu.devices.visible",
    "physical_gpus": "torchgpu.devices.visible",
    "cpu_device_info": "torchgpu.devices.listing",
    "list_devices": "torchgpu.devices.listing",
    "select_devices": "torchgpu.devices.selection",
    "set_visible_devices": "torchgpu.devices.set_visible",
    "cuda_device_count": "torchgpu.devices.cuda_status",
    "cuda_initialized": "torchgpu.devices.cuda_status",
    "cuda_unavailable_reason": "torchgpu.devices.cuda_status",
    "driver_evidence": "torchgpu.devices.cuda_status",
    "default_device": "torchgpu.devices.spec",
    "get_device": "torchgpu.devices.spec",
    "placement_device": "torchgpu.devices.spec",
    "format_bytes": "torchgpu.sizes",
    "parse_size": "torchgpu.sizes",
}

__all__ = [
    "DeviceInfo",
    "GpuProcess",
    "VisibleDevices",
    "cpu_device_info",
    "cuda_device_count",
    "cuda_initialized",
    "cuda_unavailable_reason",
    "default_device",
    "driver_evidence",
    "format_bytes",
    "get_device",
    "list_devices",
    "parse_size",
    "parse_visible_devices",
    "physical_gpus",
    "placement_device",
    "select_devices",
    "set_visible_devices",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'torchgpu.devices' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from torchgpu.devices.cuda_status import (
        cuda_device_count,
        cuda_initialized,
        cuda_unavailable_reason,
        driver_evidence,
    )
    from torchgpu.devices.info import DeviceInfo
    from torchgpu.devices.listing import cpu_device_info, list_devices
    from torchgpu.devices.nvml import GpuProcess
    from torchgpu.devices.selection import select_devices
    from torchgpu.devices.set_visible import set_visible_devices
    from torchgpu.devices.spec import default_device, get_device, placement_device
    from torchgpu.devices.visible import VisibleDevices, parse_visible_devices, physical_gpus
    from torchgpu.sizes import format_bytes, parse_size
