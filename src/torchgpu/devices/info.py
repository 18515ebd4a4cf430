"""One device as torch numbers it: :class:`DeviceInfo`, what :func:`list_devices` returns."""

from __future__ import annotations

from dataclasses import dataclass

from torchgpu.devices.nvml import GpuProcess


@dataclass(frozen=True)
class DeviceInfo:
    """One device as torch numbers it, with what NVML adds (None where unknown).

    ``kind`` is ``cuda``, ``mps`` or ``cpu``; ``index`` is torch's index (None for CPU and
    MPS). ``nvml_index`` is the same GPU in nvidia-smi's numbering; ``cuda_ordinal`` is the
    id that selects it in a fresh CUDA_VISIBLE_DEVICES. Memory is in bytes; ``used_bytes``
    counts every process, ``allocated_bytes``/``reserved_bytes`` are this process's torch
    caching allocator (None until CUDA is initialised here). ``error`` is set for a GPU
    NVML lists but cannot read (e.g. "GPU is lost").
    """

    kind: str
    index: int | None
    name: str | None
    total_bytes: int | None = None
    free_bytes: int | None = None
    used_bytes: int | None = None
    uuid: str | None = None
    pci_bus_id: str | None = None
    nvml_index: int | None = None
    cuda_ordinal: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    bf16_supported: bool | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    processes: tuple[GpuProcess, ...] | None = None
    mig: bool | None = None
    cores: int | None = None
    error: str | None = None

    @property
    def spec(self) -> str:
        """The string :func:`get_device` accepts for this device (``cuda:1``, ``cpu``)."""
        return f"cuda:{self.index}" if self.kind == "cuda" else self.kind
