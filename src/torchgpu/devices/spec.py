"""What devices exist and which one to use.

Nothing here initialises CUDA unless asked (``init_cuda=True``) or already done:
``torch.cuda.device_count()`` counts GPUs through NVML without a CUDA context, and NVML
(:mod:`torchgpu.nvml`) fills names, memory and processes. The CUDA_VISIBLE_DEVICES
rules live in :mod:`torchgpu.visible`, whether CUDA is usable in
:mod:`torchgpu.cudastatus`, the CPU's facts in :mod:`torchgpu.hostinfo`; the public
names are re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from torchgpu import nvml
from torchgpu.cudastatus import (
    cuda_device_count,
    cuda_unavailable_reason,
    driver_evidence,
    driver_read_visible_devices,
)
from torchgpu.errors import DeviceSpecError, NoDeviceError, UsageError, VisibleDevicesError
from torchgpu.hostinfo import host_info
from torchgpu.sizes import format_bytes, parse_size
from torchgpu.visible import (
    PhysicalGpu,
    VisibleDevices,
    map_visible,
    parse_visible_devices,
    validate_visible_devices,
)

__all__ = [
    "DeviceInfo",
    "GpuProcess",
    "VisibleDevices",
    "cpu_device_info",
    "cuda_unavailable_reason",
    "default_device",
    "driver_evidence",
    "format_bytes",
    "get_device",
    "list_devices",
    "parse_size",
    "parse_visible_devices",
    "placement_device",
    "select_devices",
    "set_visible_devices",
]

GpuProcess = nvml.GpuProcess
ACCEPTED_SPECS = "auto, cpu, cuda, cuda:N, N (a GPU index) or mps"
_SPEC = re.compile(r"^(auto|cpu|cuda|mps|cuda:(0|[1-9]\d*)|(0|[1-9]\d*))$")


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


# ------------------------------------------------------------------------ helpers
def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _visible_note() -> str:
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    return f" (CUDA_VISIBLE_DEVICES={raw})" if raw is not None else ""


# --------------------------------------------------------------------- get_device
def _cuda_count_or_raise(spec: str) -> int:
    reason = cuda_unavailable_reason()
    if reason:
        raise NoDeviceError(f"{spec} requested but CUDA cannot be used: {reason}")
    return cuda_device_count()


def _check_index(index: int, count: int, spec: str) -> torch.device:
    if index >= count:
        raise DeviceSpecError(
            f"{spec} requested but {count} GPU{'s are' if count != 1 else ' is'} visible"
            f"{_visible_note()}: use cuda:0..cuda:{count - 1} or --device cpu"
        )
    return torch.device("cuda", index)


def _local_rank() -> int | None:
    raw = os.environ.get("LOCAL_RANK")
    if raw is None or not raw.strip().isdigit():
        return None
    return int(raw)


def get_device(spec: str | int | torch.device = "auto") -> torch.device:
    """The torch.device ``spec`` names, validated now rather than at first use.

    Accepted: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``N`` (an int or digit string, a
    GPU index) and ``mps``, or a torch.device. ``auto`` is ``TORCHGPU_DEVICE`` when set,
    else ``cuda:LOCAL_RANK`` under torchrun, else ``cuda:0``, else ``mps``, else ``cpu``.
    ``cuda`` is the current CUDA device if CUDA is initialised, else ``cuda:LOCAL_RANK``
    under torchrun, else ``cuda:0``. GPU indices are checked against the visible count.

    Raises DeviceSpecError (bad form, index out of range) or NoDeviceError (CUDA/MPS not
    usable here, with the reason). Never initialises CUDA.
    """
    if isinstance(spec, torch.device):
        if spec.type not in ("cpu", "cuda", "mps"):
            raise DeviceSpecError(
                f"device {spec} is not supported here: use one of {ACCEPTED_SPECS}"
            )
        text = spec.type if spec.index is None or spec.type != "cuda" else f"cuda:{spec.index}"
        return get_device(text)
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise DeviceSpecError(f"device {spec!r} is not a device: use one of {ACCEPTED_SPECS}")
    if isinstance(spec, int):
        if spec < 0:
            raise DeviceSpecError(f"device {spec} is negative: use one of {ACCEPTED_SPECS}")
        spec = str(spec)
    match = _SPEC.match(spec)
    if match is None:
        hint = ""
        if spec.strip().lower() in ("gpu", "cuda", "nvidia") or spec.lower().startswith("cuda"):
            hint = " (lower-case `cuda` or `cuda:N`, no spaces)"
        raise DeviceSpecError(
            f"device {spec!r} is not understood: use one of {ACCEPTED_SPECS}{hint}, "
            "e.g. --device cuda:0 or --device cpu"
        )
    if spec == "auto":
        return _auto_device()
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "mps":
        if not _mps_available():
            raise NoDeviceError(
                "mps requested but Apple's Metal backend is not available here (it needs "
                "macOS on Apple silicon and a torch built with MPS): use cpu or cuda"
            )
        return torch.device("mps")
    count = _cuda_count_or_raise(spec)
    if spec == "cuda":
        return _check_index(_default_cuda_index(), count, "cuda")
    index = int(spec.split(":")[-1])
    return _check_index(index, count, f"cuda:{index}")


def _default_cuda_index() -> int:
    if _cuda_initialized():
        return int(torch.cuda.current_device())
    return _local_rank() or 0


def _auto_device() -> torch.device:
    override = os.environ.get("TORCHGPU_DEVICE")
    if override is not None and override != "auto":
        try:
            return get_device(override)
        except (DeviceSpecError, NoDeviceError) as error:
            # Name the variable: the user did not type this spec on the command line.
            raise type(error)(
                f"TORCHGPU_DEVICE={override!r}: {str(error).rstrip('.')}; unset "
                "TORCHGPU_DEVICE or set it to cpu"
            ) from None
    count = cuda_device_count() if torch.version.cuda is not None else 0
    if count > 0:
        local_rank = _local_rank()
        if local_rank is not None and local_rank >= count:
            raise NoDeviceError(
                f"LOCAL_RANK={local_rank} but {count} GPU(s) are visible{_visible_note()}: "
                f"start at most {count} processes per node (--nproc {count}) or use --device cpu"
            )
        return torch.device("cuda", local_rank or 0)
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


# -------------------------------------------------------------------- list_devices
def physical_gpus(gpus: tuple[nvml.NvmlGpu, ...]) -> list[PhysicalGpu]:
    """What :func:`torchgpu.visible.map_visible` needs to know about NVML's GPUs."""
    return [
        PhysicalGpu(
            nvml_index=g.nvml_index,
            uuid=g.uuid,
            pci_bus_id=g.pci_bus_id,
            compute_capability=g.compute_capability,
            total_bytes=g.total_bytes,
            mig_uuids=tuple(m.uuid for m in g.mig_devices if m.uuid),
        )
        for g in gpus
    ]


def _torch_memory(index: int) -> tuple[int | None, int | None]:
    """(allocated, reserved) bytes of this process's caching allocator, if CUDA is up."""
    if torch.version.cuda is None or not _cuda_initialized():
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
    if not (init_cuda or _cuda_initialized()):
        return DeviceInfo(kind="cuda", index=index, name=None)
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
    :mod:`torchgpu.visible`), so this works even where torch cannot use them (a CPU-only
    build lists the machine's GPUs; :func:`cuda_unavailable_reason` says why torch can't).
    Without NVML, GPUs come from torch: named only if CUDA is initialised already or
    ``init_cuda=True`` allows initialising it. Never raises for missing NVML fields.
    """
    devices: list[DeviceInfo] = []
    inventory = nvml.read_inventory()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inventory.available and inventory.gpus:
        by_index = {g.nvml_index: g for g in inventory.gpus}
        visible = parse_visible_devices(raw, device_count=len(inventory.gpus))
        targets = map_visible(
            visible, physical_gpus(inventory.gpus), os.environ.get("CUDA_DEVICE_ORDER")
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
    elif torch.version.cuda is not None:
        devices += [_torch_gpu_info(i, init_cuda) for i in range(cuda_device_count())]
    if _mps_available():
        devices.append(DeviceInfo(kind="mps", index=None, name="Apple MPS", bf16_supported=True))
    devices.append(cpu_device_info())
    return devices


# ------------------------------------------------------------------ select_devices
def select_devices(
    n: int,
    min_free: int | str | None = None,
    max_util: float | None = None,
    *,
    init_cuda: bool = False,
) -> list[int]:
    """The ``n`` GPUs with the most free memory that pass the filters, as ascending ids for
    a fresh CUDA_VISIBLE_DEVICES (e.g. ``[0, 3]``).

    ``min_free``: bytes or a size string (``8GiB``, ``500MB``); ``max_util``: percent.
    A GPU whose free memory or utilisation is unknown fails a filter on it. Only GPUs
    visible to this process are considered. Raises UsageError for bad arguments and
    NoDeviceError (exit 3) when fewer than ``n`` qualify, naming each GPU's reason.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise UsageError(f"-n {n!r} is not a positive number of GPUs: use -n 1 or more")
    min_free_bytes = parse_size(min_free) if isinstance(min_free, str) else min_free
    if max_util is not None and not 0 <= max_util <= 100:
        raise UsageError(f"--max-util {max_util} is not a percentage: use 0..100")
    gpus = [d for d in list_devices(init_cuda=init_cuda) if d.kind == "cuda"]
    passed: list[DeviceInfo] = []
    rejected: list[str] = []
    for gpu in gpus:
        why = _rejection(gpu, min_free_bytes, max_util)
        if why:
            rejected.append(f"cuda:{gpu.index} {why}")
        else:
            passed.append(gpu)
    if len(passed) < n:
        if not gpus:
            reason = cuda_unavailable_reason() or "no GPU is visible to this process"
            raise NoDeviceError(f"{n} GPU(s) requested but none is visible: {reason}")
        detail = "; ".join(rejected) if rejected else "no other GPU"
        raise NoDeviceError(
            f"{n} GPU(s) requested but only {len(passed)} of {len(gpus)} qualify ({detail}): "
            "ask for fewer (-n), relax --min-free/--max-util, or free the GPUs"
        )
    passed.sort(key=lambda d: -(d.free_bytes or 0))  # stable: ties keep torch order
    chosen = passed[:n]
    return sorted(d.cuda_ordinal if d.cuda_ordinal is not None else d.index or 0 for d in chosen)


def _rejection(gpu: DeviceInfo, min_free: int | None, max_util: float | None) -> str:
    if gpu.error:
        return f"cannot be read ({gpu.error})"
    if min_free is not None:
        if gpu.free_bytes is None:
            return "has unknown free memory"
        if gpu.free_bytes < min_free:
            return f"has {format_bytes(gpu.free_bytes)} free < {format_bytes(min_free)}"
    if max_util is not None:
        if gpu.utilization_pct is None:
            return "has unknown utilisation"
        if gpu.utilization_pct > max_util:
            return f"is {gpu.utilization_pct}% busy > {max_util:g}%"
    return ""


# ----------------------------------------------------------- set_visible_devices
def set_visible_devices(ids: str | list[int] | list[str] | tuple[int | str, ...]) -> str:
    """Set CUDA_VISIBLE_DEVICES for this process (and its children); returns the value set.

    Validates strictly (garbage, negatives, duplicates, mixed ordinals and UUIDs, and
    ordinals past the last GPU when NVML can count them) and refuses once CUDA is
    initialised here, because the driver reads the variable only once, at start-up.

    The driver can also have started without CUDA being initialised: when torch cannot
    count GPUs through NVML (NVML unavailable, or ``MIG-`` ids in the variable),
    ``torch.cuda.device_count()`` asks the driver, which reads the variable then. If an
    earlier torchgpu call (``get_device``, ``list_devices``...) counted that way, the new
    value still reaches child processes (torchrun workers) but not this one: a
    RuntimeWarning says so. Call this first thing, before any other torchgpu call.
    """
    if _cuda_initialized():
        raise VisibleDevicesError(
            f"cannot set CUDA_VISIBLE_DEVICES={ids!r}: CUDA is already initialised in this "
            "process and the driver read the variable at start-up. Set it before anything "
            "touches CUDA (first thing in the script) or in the shell: "
            "CUDA_VISIBLE_DEVICES=1,2 python train.py"
        )
    try:
        value = validate_visible_devices(ids)
    except ValueError as error:
        raise VisibleDevicesError(
            f"CUDA_VISIBLE_DEVICES {ids!r} is invalid: {error}. Use comma-separated GPU "
            'ordinals ("0,2") or GPU-/MIG- UUIDs, each once; "" hides every GPU'
        ) from None
    inventory = nvml.read_inventory()
    if inventory.available and inventory.gpus and value and value[0].isdigit():
        count = len(inventory.gpus)
        missing = [t for t in value.split(",") if int(t) >= count]
        if missing:
            raise VisibleDevicesError(
                f"CUDA_VISIBLE_DEVICES {value!r} names GPU {missing[0]} but this machine has "
                f"{count} (0..{count - 1}); the driver would silently stop there. "
                "Run `torchgpu devices` to see them"
            )
    read, before = driver_read_visible_devices()
    if read and value != before:
        warnings.warn(
            f"CUDA_VISIBLE_DEVICES={value!r} applies to child processes only: the CUDA "
            f"driver of this process already read it as {before!r} when GPUs were counted "
            "(torch could not count them through NVML). Set it before the first torchgpu "
            "call, or in the shell: CUDA_VISIBLE_DEVICES=1,2 python train.py",
            RuntimeWarning,
            stacklevel=2,
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = value
    return value


# ---------------------------------------------------------------- default_device
def placement_device(spec: str | int | torch.device) -> torch.device:
    """The torch.device to move or allocate on: any device ``torch.device(spec)`` accepts.

    Unlike :func:`get_device` (which *selects* a training device and accepts only the
    kinds torchgpu trains on), placement takes every device torch knows, ``meta``
    included (deferred initialisation). The strings ``auto``, ``N`` and the ``cuda`` and
    ``mps`` forms still go through :func:`get_device`, so a GPU index torch does not
    have fails here, clearly, rather than at the first copy. A ``torch.device`` and
    other kinds (``xpu``, ``hpu``...) are checked by torch itself when something is
    moved there.
    Raises DeviceSpecError for a string torch cannot parse.
    """
    if isinstance(spec, torch.device):
        return spec  # already explicit: torch checks it when something moves there
    if isinstance(spec, bool) or not isinstance(spec, (int, str)):
        raise DeviceSpecError(
            f"device {spec!r} is not a device: pass a torch.device or a string such as "
            "'cpu', 'cuda:0' or 'meta'"
        )
    if isinstance(spec, int) or _SPEC.match(spec):
        return get_device(spec)
    try:
        parsed = torch.device(spec)
    except (RuntimeError, ValueError, TypeError) as error:
        raise DeviceSpecError(
            f"device {spec!r} is not a device torch knows ({error}): use e.g. 'cpu', "
            "'cuda', 'cuda:0', 'mps' or 'meta'"
        ) from None
    if parsed.type in ("cuda", "mps"):
        return get_device(parsed)
    return parsed


@contextlib.contextmanager
def default_device(device: str | int | torch.device) -> Iterator[torch.device]:
    """Within the block, factory calls (``torch.zeros``, ``nn.Linear``...) allocate on
    ``device``; the previous default is restored on exit, exceptions included.

    Today's replacement for ``torch.set_default_tensor_type('torch.cuda.FloatTensor')``
    (deprecated), built on ``torch.device`` as a context manager. It affects the current
    thread only; explicit ``device=`` arguments still win. ``device`` is any device
    torch accepts (:func:`placement_device`): ``default_device("meta")`` builds a model
    without allocating its weights (deferred initialisation).
    """
    resolved = placement_device(device)
    with resolved:
        yield resolved
