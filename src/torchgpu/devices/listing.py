"""What devices this process can see: :func:`list_devices` and :func:`cpu_device_info`.

GPUs come from NVML (:mod:`torchgpu.devices.nvml`) in torch's numbering
(:func:`torchgpu.devices.visible.map_nvml`), so listing them needs neither a CUDA
context nor torch itself: with NVML available, or on a CPU-only build of torch, this
module never imports torch. Without NVML, a CUDA build of torch is asked instead.
"""

from __future__ import annotations

import os

from torchgpu.devices import nvml
from torchgpu.devices.cuda_status import cuda_device_count, cuda_initialized
from torchgpu.devices.host import host_info
from torchgpu.devices.info import DeviceInfo
from torchgpu.devices.torch_build import mps_available, torch_build
from torchgpu.devices.visible import map_nvml


def _torch_memory(index: int) -> tuple[int | None, int | None]:
    """(allocated, reserved) bytes of this process's caching allocator, if CUDA is up."""
    if not cuda_initialized():  # also when torch is not imported: nothing allocated
        return None, None
    import torch

    if torch.version.cuda is None:
        return None, None
    return int(torch.cuda.memory_allocated(index)), int(torch.cuda.memory_reserved(index))


def _bf16(capability: tuple[int, int] | None) -> bool | None:
    return None if capability is None else capability >= (8, 0)


def _gpu_info(
    torch_index: int, gpu: nvml.NvmlGpu, target_mig: str | None, ordinal: int
) -> DeviceInfo:
    allocated, reserved = _torch_memory(torch_index)
    memory_from: nvml.NvmlGpu = gpu
    name = gpu.name
    if target_mig is not None:
        mig = next((m for m in gpu.mig_devices if m.uuid == target_mig), None)
        if mig is not None:
            memory_from = mig
            name = f"{gpu.name or 'GPU'} MIG {mig.name or ''}".strip()
    return DeviceInfo(
        kind="cuda",
        index=torch_index,
        name=name,
        total_bytes=memory_from.total_bytes,
        free_bytes=memory_from.free_bytes,
        used_bytes=memory_from.used_bytes,
        uuid=target_mig or gpu.uuid,
        pci_bus_id=gpu.pci_bus_id,
        nvml_index=gpu.nvml_index,
        cuda_ordinal=ordinal,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        compute_capability=gpu.compute_capability,
        bf16_supported=_bf16(gpu.compute_capability),
        utilization_pct=gpu.utilization_pct,
        temperature_c=gpu.temperature_c,
        power_w=gpu.power_w,
        power_limit_w=gpu.power_limit_w,
        processes=gpu.processes,
        mig=gpu.mig_enabled,
        error=gpu.error,
    )


def _torch_gpu_info(index: int, init_cuda: bool) -> DeviceInfo:
    """A GPU NVML could not describe, from torch (properties need CUDA initialised)."""
    if not (init_cuda or cuda_initialized()):
        return DeviceInfo(kind="cuda", index=index, name=None)
    import torch

    props = torch.cuda.get_device_properties(index)
    free, total = torch.cuda.mem_get_info(index)
    capability = (int(props.major), int(props.minor))
    allocated, reserved = _torch_memory(index)
    return DeviceInfo(
        kind="cuda",
        index=index,
        name=str(props.name),
        total_bytes=int(total),
        free_bytes=int(free),
        used_bytes=int(total - free),
        uuid=f"GPU-{props.uuid}" if getattr(props, "uuid", None) else None,
        allocated_bytes=allocated,
        reserved_bytes=reserved,
        compute_capability=capability,
        bf16_supported=_bf16(capability),
    )


def cpu_device_info() -> DeviceInfo:
    """The CPU entry: name, logical cores, RAM total and available (bytes)."""
    host = host_info()
    total, available = host.total_bytes, host.available_bytes
    return DeviceInfo(
        kind="cpu",
        index=None,
        name=host.cpu_name,
        total_bytes=total,
        free_bytes=available,
        used_bytes=total - available if total is not None and available is not None else None,
        cores=host.cores,
    )


def list_devices(*, init_cuda: bool = False) -> list[DeviceInfo]:
    """Every GPU this process can see (torch's numbering), then MPS if present, then the CPU.

    GPUs come from NVML mapped through CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER (see
    :mod:`torchgpu.devices.visible`), so this works even where torch cannot use them (a
    CPU-only build lists the machine's GPUs; :func:`cuda_unavailable_reason` says why
    torch can't). Without NVML, GPUs come from a CUDA build of torch: named only if CUDA
    is initialised already or ``init_cuda=True`` allows initialising it. Never raises for
    missing NVML fields; imports torch only when it has to ask it.
    """
    devices: list[DeviceInfo] = []
    inventory = nvml.read_inventory()
    if inventory.available and inventory.gpus:
        by_index = {g.nvml_index: g for g in inventory.gpus}
        targets = map_nvml(
            inventory.gpus,
            os.environ.get("CUDA_VISIBLE_DEVICES"),
            os.environ.get("CUDA_DEVICE_ORDER"),
        )
        for target in targets:
            devices.append(
                _gpu_info(
                    target.torch_index,
                    by_index[target.nvml_index],
                    target.mig_uuid,
                    target.cuda_ordinal,
                )
            )
    elif torch_build().cuda is not None:
        devices += [_torch_gpu_info(i, init_cuda) for i in range(cuda_device_count())]
    if mps_available():
        devices.append(DeviceInfo(kind="mps", index=None, name="Apple MPS", bf16_supported=True))
    devices.append(cpu_device_info())
    return devices
