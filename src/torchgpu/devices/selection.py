"""Picking GPUs for a job: :func:`select_devices` (``torchgpu select``).

Works from :func:`torchgpu.devices.list_devices`, so with NVML available it needs no
torch: ``CUDA_VISIBLE_DEVICES=$(torchgpu select -n 2)`` before every job stays fast.
"""

from __future__ import annotations

from torchgpu.devices.cuda_status import cuda_unavailable_reason
from torchgpu.devices.info import DeviceInfo
from torchgpu.devices.listing import list_devices
from torchgpu.errors import NoDeviceError, UsageError
from torchgpu.sizes import format_bytes, parse_size


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
