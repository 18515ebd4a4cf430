"""A thin, optional NVML reader (nvidia-ml-py's ``pynvml``).

NVML sees every physical GPU, in PCI order, without creating a CUDA context, so it is
how torchgpu learns names, memory, utilisation and processes without initialising CUDA.
Everything here degrades instead of failing: no ``pynvml`` installed, no driver, or a
field the GPU does not support gives ``None`` (or an :class:`NvmlInventory` whose
``error`` says why), never an exception. A GPU that cannot be read at all ("GPU is
lost") is still listed, with its ``error`` set.

Tests and hypothetical machines replace the reader: :func:`set_backend` installs any
object with a ``read() -> NvmlInventory`` method (:class:`StaticBackend` holds a fixed
inventory), and :class:`PynvmlBackend` accepts a fake ``pynvml`` module.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pwd
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

# NVML return codes we treat specially (values from nvml.h; stable across releases).
NOT_SUPPORTED = 3
GPU_IS_LOST = 15


@dataclass(frozen=True)
class GpuProcess:
    """A process holding GPU memory. ``name``/``user`` are None when /proc cannot tell
    (e.g. a process in another container's PID namespace)."""

    pid: int
    name: str | None = None
    user: str | None = None
    used_bytes: int | None = None


@dataclass(frozen=True)
class NvmlGpu:
    """One physical GPU (or MIG instance, inside ``mig_devices``) as NVML reports it.

    Every field but ``nvml_index`` may be None: unsupported by this GPU, or unreadable.
    ``error`` is set when the device could not be read at all (e.g. "GPU is lost").
    """

    nvml_index: int
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    used_bytes: int | None = None
    compute_capability: tuple[int, int] | None = None
    utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    mig_enabled: bool | None = None
    processes: tuple[GpuProcess, ...] | None = None
    mig_devices: tuple[NvmlGpu, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class NvmlInventory:
    """What NVML reports for the machine. ``error`` says why NVML could not be used
    (library missing, driver not loaded); then ``gpus`` is empty."""

    gpus: tuple[NvmlGpu, ...] = ()
    driver_version: str | None = None
    nvml_version: str | None = None
    cuda_driver_version: str | None = None  # e.g. "12.4": the newest CUDA the driver runs
    error: str | None = None

    @property
    def available(self) -> bool:
        """True when NVML answered (it may still report zero GPUs)."""
        return self.error is None


class NvmlBackend(Protocol):
    """Anything that can produce an inventory."""

    def read(self) -> NvmlInventory:
        """Read the machine; must not raise."""
        ...


class StaticBackend:
    """A fixed inventory: for tests and for planning on a machine you do not have."""

    def __init__(self, inventory: NvmlInventory) -> None:
        self.inventory = inventory

    def read(self) -> NvmlInventory:
        return self.inventory


def process_identity(pid: int) -> tuple[str | None, str | None]:
    """(command name, user name) of ``pid`` from /proc, or None where unknown."""
    name: str | None = None
    user: str | None = None
    with contextlib.suppress(OSError), open(f"/proc/{pid}/comm", encoding="utf-8") as f:
        name = f.read().strip() or None
    with contextlib.suppress(OSError, KeyError):
        user = pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
    return name, user


class _Lost(Exception):
    """Raised inside the reader when NVML says the GPU is lost."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace").strip("\0").strip() or None
    return str(value).strip() or None


class PynvmlBackend:
    """Reads NVML through ``pynvml`` (nvidia-ml-py).

    ``module``: a ``pynvml``-like module (default: import ``pynvml``; tests pass a fake).
    ``identify``: pid -> (name, user) (default :func:`process_identity`).
    """

    def __init__(
        self,
        module: Any = None,
        identify: Callable[[int], tuple[str | None, str | None]] = process_identity,
    ) -> None:
        self._module = module
        self._identify = identify

    def read(self) -> NvmlInventory:
        nv = self._module
        if nv is None:
            try:
                nv = importlib.import_module("pynvml")
            except ImportError:
                return NvmlInventory(
                    error="nvidia-ml-py is not installed (pip install 'torchgpu[nvml]')"
                )
        try:
            nv.nvmlInit()
        except Exception as error:  # NVMLError or OSError: no library, no driver
            return NvmlInventory(error=f"NVML unavailable: {_text(str(error)) or type(error)}")
        try:
            return self._read_all(nv)
        finally:
            with contextlib.suppress(Exception):
                nv.nvmlShutdown()

    def _read_all(self, nv: Any) -> NvmlInventory:
        count = self._field(nv, nv.nvmlDeviceGetCount) or 0
        gpus = tuple(self._read_gpu(nv, index) for index in range(int(count)))
        cuda = self._field(nv, getattr(nv, "nvmlSystemGetCudaDriverVersion", None))
        return NvmlInventory(
            gpus=gpus,
            driver_version=_text(self._field(nv, nv.nvmlSystemGetDriverVersion)),
            nvml_version=_text(self._field(nv, getattr(nv, "nvmlSystemGetNVMLVersion", None))),
            cuda_driver_version=(
                f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda is not None else None
            ),
        )

    def _field(self, nv: object, fn: Callable[..., Any] | None, *args: object) -> Any:
        """``fn(*args)``, or None when unsupported/unreadable; _Lost when the GPU is gone."""
        if fn is None:
            return None
        try:
            return fn(*args)
        except Exception as error:
            if getattr(error, "value", None) == GPU_IS_LOST:
                raise _Lost(_text(str(error)) or "GPU is lost") from error
            return None

    def _read_gpu(self, nv: Any, index: int) -> NvmlGpu:
        seen: dict[str, str | None] = {}
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except Exception as error:
            return NvmlGpu(nvml_index=index, error=_text(str(error)) or "unreadable")
        try:
            seen["uuid"] = _text(self._field(nv, nv.nvmlDeviceGetUUID, handle))
            seen["name"] = _text(self._field(nv, nv.nvmlDeviceGetName, handle))
            return self._read_details(nv, index, handle, seen)
        except _Lost as lost:
            return NvmlGpu(nvml_index=index, error=lost.message, uuid=seen.get("uuid"),
                           name=seen.get("name"), pci_bus_id=seen.get("pci_bus_id"))

    def _read_details(
        self, nv: Any, index: int, handle: object, seen: dict[str, str | None]
    ) -> NvmlGpu:
        pci = self._field(nv, nv.nvmlDeviceGetPciInfo, handle)
        seen["pci_bus_id"] = _text(getattr(pci, "busId", None)) if pci is not None else None
        memory = self._field(nv, nv.nvmlDeviceGetMemoryInfo, handle)
        capability = self._field(nv, nv.nvmlDeviceGetCudaComputeCapability, handle)
        utilization = self._field(nv, nv.nvmlDeviceGetUtilizationRates, handle)
        temperature = self._field(
            nv, nv.nvmlDeviceGetTemperature, handle, getattr(nv, "NVML_TEMPERATURE_GPU", 0)
        )
        power_mw = self._field(nv, nv.nvmlDeviceGetPowerUsage, handle)
        limit_mw = self._field(nv, nv.nvmlDeviceGetEnforcedPowerLimit, handle)
        mig_mode = self._field(nv, getattr(nv, "nvmlDeviceGetMigMode", None), handle)
        mig_enabled = bool(mig_mode[0]) if mig_mode is not None else None
        return NvmlGpu(
            nvml_index=index,
            uuid=seen["uuid"],
            name=seen["name"],
            pci_bus_id=seen["pci_bus_id"],
            total_bytes=_int(getattr(memory, "total", None)),
            free_bytes=_int(getattr(memory, "free", None)),
            used_bytes=_int(getattr(memory, "used", None)),
            compute_capability=(
                (int(capability[0]), int(capability[1])) if capability is not None else None
            ),
            utilization_pct=_int(getattr(utilization, "gpu", None)),
            temperature_c=_int(temperature),
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            power_limit_w=limit_mw / 1000.0 if limit_mw is not None else None,
            mig_enabled=mig_enabled,
            processes=self._processes(nv, handle),
            mig_devices=self._mig_devices(nv, handle) if mig_enabled else (),
        )

    def _processes(self, nv: Any, handle: object) -> tuple[GpuProcess, ...] | None:
        raw = self._field(nv, nv.nvmlDeviceGetComputeRunningProcesses, handle)
        if raw is None:
            return None
        processes = []
        for item in raw:
            pid = int(item.pid)
            name, user = self._identify(pid)
            used = getattr(item, "usedGpuMemory", None)
            processes.append(GpuProcess(pid=pid, name=name, user=user, used_bytes=_int(used)))
        return tuple(processes)

    def _mig_devices(self, nv: Any, handle: object) -> tuple[NvmlGpu, ...]:
        count = self._field(nv, getattr(nv, "nvmlDeviceGetMaxMigDeviceCount", None), handle)
        devices = []
        for slot in range(int(count or 0)):
            mig = self._field(nv, nv.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot)
            if mig is None:  # empty slot
                continue
            memory = self._field(nv, nv.nvmlDeviceGetMemoryInfo, mig)
            devices.append(
                NvmlGpu(
                    nvml_index=slot,
                    uuid=_text(self._field(nv, nv.nvmlDeviceGetUUID, mig)),
                    name=_text(self._field(nv, nv.nvmlDeviceGetName, mig)),
                    total_bytes=_int(getattr(memory, "total", None)),
                    free_bytes=_int(getattr(memory, "free", None)),
                    used_bytes=_int(getattr(memory, "used", None)),
                )
            )
        return tuple(devices)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


_backend: NvmlBackend | None = None


def set_backend(backend: NvmlBackend | None) -> NvmlBackend | None:
    """Install ``backend`` for every later read (None restores pynvml); returns the old one."""
    global _backend
    previous, _backend = _backend, backend
    return previous


@contextlib.contextmanager
def use_backend(backend: NvmlBackend) -> Iterator[NvmlBackend]:
    """``with use_backend(StaticBackend(inv)):`` reads ``inv`` inside the block."""
    previous = set_backend(backend)
    try:
        yield backend
    finally:
        set_backend(previous)


def read_inventory() -> NvmlInventory:
    """The machine's NVML inventory through the installed backend; never raises."""
    backend = _backend if _backend is not None else PynvmlBackend()
    try:
        return backend.read()
    except Exception as error:  # a broken backend must not break `torchgpu devices`
        return NvmlInventory(error=f"NVML read failed: {error}")
