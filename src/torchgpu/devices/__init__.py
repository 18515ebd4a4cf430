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

from typing import TYPE_CHECKING

from torchgpu._lazy import exports

if TYPE_CHECKING:  # the exports, one name per line (read by torchgpu._lazy)
    from torchgpu.devices.cuda_status import cuda_device_count as cuda_device_count
    from torchgpu.devices.cuda_status import cuda_initialized as cuda_initialized
    from torchgpu.devices.cuda_status import cuda_unavailable_reason as cuda_unavailable_reason
    from torchgpu.devices.cuda_status import driver_evidence as driver_evidence
    from torchgpu.devices.info import DeviceInfo as DeviceInfo
    from torchgpu.devices.listing import cpu_device_info as cpu_device_info
    from torchgpu.devices.listing import list_devices as list_devices
    from torchgpu.devices.nvml import GpuProcess as GpuProcess
    from torchgpu.devices.selection import select_devices as select_devices
    from torchgpu.devices.set_visible import set_visible_devices as set_visible_devices
    from torchgpu.devices.spec import default_device as default_device
    from torchgpu.devices.spec import get_device as get_device
    from torchgpu.devices.spec import placement_device as placement_device
    from torchgpu.devices.visible import VisibleDevices as VisibleDevices
    from torchgpu.devices.visible import parse_visible_devices as parse_visible_devices
    from torchgpu.devices.visible import physical_gpus as physical_gpus
    from torchgpu.sizes import format_bytes as format_bytes
    from torchgpu.sizes import parse_size as parse_size
else:
    __getattr__, __dir__, __all__ = exports(__name__, __file__)
