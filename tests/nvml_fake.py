"""A fake ``pynvml`` module: three GPUs, one with NotSupported fields, one lost.

Used by the NVML, devices and CLI tests, through the real :class:`PynvmlBackend`
reader, so the error handling of the reader itself is what is tested.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torchgpu.devices.nvml import GPU_IS_LOST, NOT_SUPPORTED, NvmlInventory, PynvmlBackend

GIB = 1 << 30


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {NOT_SUPPORTED: "Not Supported", GPU_IS_LOST: "GPU is lost"}.get(
            self.value, f"NVML error {self.value}"
        )


def _unsupported(*_args: Any) -> Any:
    raise NVMLError(NOT_SUPPORTED)


def _lost(*_args: Any) -> Any:
    raise NVMLError(GPU_IS_LOST)


# Per GPU: field -> value, or a function that raises.
GPUS: list[dict[str, Any]] = [
    {
        "uuid": "GPU-11111111-aaaa-bbbb-cccc-000000000000",
        "name": "NVIDIA A100-SXM4-80GB",
        "pci": SimpleNamespace(busId=b"00000000:07:00.0"),
        "memory": SimpleNamespace(total=80 * GIB, free=60 * GIB, used=20 * GIB),
        "cc": (8, 0),
        "util": SimpleNamespace(gpu=35, memory=10),
        "temp": 41,
        "power": 95_500,
        "limit": 400_000,
        "mig": (0, 0),
        "procs": [SimpleNamespace(pid=4242, usedGpuMemory=19 * GIB)],
    },
    {
        "uuid": "GPU-22222222-aaaa-bbbb-cccc-000000000000",
        "name": "NVIDIA GeForce GTX 1080",
        "pci": SimpleNamespace(busId="00000000:0A:00.0"),
        "memory": SimpleNamespace(total=8 * GIB, free=7 * GIB, used=1 * GIB),
        "cc": (6, 1),
        "util": _unsupported,
        "temp": 30,
        "power": _unsupported,
        "limit": _unsupported,
        "mig": _unsupported,
        "procs": _unsupported,
    },
    {
        "uuid": "GPU-33333333-aaaa-bbbb-cccc-000000000000",
        "name": "NVIDIA A100-SXM4-80GB",
        "pci": SimpleNamespace(busId=b"00000000:0B:00.0"),
        "memory": _lost,
    },
]


def make_pynvml(gpus: list[dict[str, Any]] | None = None, init_error: int | None = None) -> Any:
    """A module object with the pynvml functions the reader calls."""
    table = GPUS if gpus is None else gpus
    calls = {"init": 0, "shutdown": 0}

    def field(name: str) -> Any:
        def get(handle: int, *_: Any) -> Any:
            value = table[handle].get(name, _unsupported)
            return value(handle) if callable(value) else value

        return get

    def init() -> None:
        calls["init"] += 1
        if init_error is not None:
            raise NVMLError(init_error)

    def shutdown() -> None:
        calls["shutdown"] += 1

    return SimpleNamespace(
        calls=calls,
        NVMLError=NVMLError,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlShutdown=shutdown,
        nvmlDeviceGetCount=lambda: len(table),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlSystemGetDriverVersion=lambda: "550.54.15",
        nvmlSystemGetNVMLVersion=lambda: b"12.550.54.15",
        nvmlSystemGetCudaDriverVersion=lambda: 12040,
        nvmlDeviceGetUUID=field("uuid"),
        nvmlDeviceGetName=field("name"),
        nvmlDeviceGetPciInfo=field("pci"),
        nvmlDeviceGetMemoryInfo=field("memory"),
        nvmlDeviceGetCudaComputeCapability=field("cc"),
        nvmlDeviceGetUtilizationRates=field("util"),
        nvmlDeviceGetTemperature=field("temp"),
        nvmlDeviceGetPowerUsage=field("power"),
        nvmlDeviceGetEnforcedPowerLimit=field("limit"),
        nvmlDeviceGetMigMode=field("mig"),
        nvmlDeviceGetComputeRunningProcesses=field("procs"),
    )


def identify(pid: int) -> tuple[str | None, str | None]:
    return ("python", "alice") if pid == 4242 else (None, None)


def fake_backend(**kw: Any) -> PynvmlBackend:
    return PynvmlBackend(module=make_pynvml(**kw), identify=identify)


def fake_inventory() -> NvmlInventory:
    return fake_backend().read()
