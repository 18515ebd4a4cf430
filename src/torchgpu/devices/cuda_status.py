"""Whether CUDA can be used in this process, and counting GPUs without initialising it.

- :func:`cuda_unavailable_reason` says, in one sentence with a fix, why CUDA cannot be
  used here (CPU-only build, no driver, CUDA_VISIBLE_DEVICES hiding every GPU...).
- :func:`cuda_device_count` is ``torch.cuda.device_count()`` that also remembers when
  the count had to go through the CUDA driver. torch counts through NVML when it can
  (no CUDA context, CUDA_VISIBLE_DEVICES still free to change); when NVML discovery
  fails, or CUDA_VISIBLE_DEVICES names ``MIG-`` instances, it falls back to
  ``cudaGetDeviceCount``, which starts the driver, and the driver reads
  CUDA_VISIBLE_DEVICES at that moment, once. :func:`driver_read_visible_devices` tells
  :func:`torchgpu.set_visible_devices` that a later change would not apply here.
"""

from __future__ import annotations

import os
import shutil
import warnings

import torch

from torchgpu import nvml
from torchgpu.visible import parse_visible_devices

_UNSET = "<unset>"
# The CUDA_VISIBLE_DEVICES value the driver read when torchgpu's count went through it
# (_UNSET when the variable was unset); None while that has not happened.
_driver_read: str | None = None


def driver_evidence(inventory: nvml.NvmlInventory | None = None) -> str | None:
    """Where we see an NVIDIA driver (without CUDA): NVML, /proc, or nvidia-smi on PATH."""
    if inventory is not None and inventory.available and inventory.gpus:
        return f"NVML lists {len(inventory.gpus)} GPU(s)"
    if os.path.exists("/proc/driver/nvidia/version"):
        return "/proc/driver/nvidia/version exists"
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is on PATH"
    return None


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())  # type: ignore[no-untyped-call]


def count_goes_through_driver() -> bool:
    """True when ``torch.cuda.device_count()`` would ask the CUDA driver, not NVML.

    Mirrors torch's own choice: a torch compiled without CUDA never asks; ``MIG-`` ids
    in CUDA_VISIBLE_DEVICES always do; otherwise torch's NVML count failing (< 0) does.
    """
    # torch.cuda._is_compiled() tests this attribute; a CPU build answers 0 without asking.
    if not hasattr(torch._C, "_cuda_getDeviceCount"):
        return False
    if os.environ.get("CUDA_VISIBLE_DEVICES", "").strip().startswith("MIG-"):
        return True
    probe = getattr(torch.cuda, "_device_count_nvml", None)
    if probe is None:  # a torch without the helper: judge by our own NVML reader
        return not nvml.read_inventory().available
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Can't initialize NVML": torch warns again itself
        try:
            return int(probe()) < 0
        except Exception:
            return True


def cuda_device_count() -> int:
    """``torch.cuda.device_count()``, remembering when the count went through the driver.

    Never initialises a CUDA context. When the count needs the driver (see the module
    docstring) and the driver is there, the CUDA_VISIBLE_DEVICES value it read is kept
    for :func:`driver_read_visible_devices`.
    """
    global _driver_read
    through_driver = (
        _driver_read is None
        and torch.version.cuda is not None
        and not _cuda_initialized()
        and count_goes_through_driver()
    )
    count = int(torch.cuda.device_count())
    if through_driver and (count > 0 or driver_evidence() is not None):
        _driver_read = os.environ.get("CUDA_VISIBLE_DEVICES", _UNSET)
    return count


def driver_read_visible_devices() -> tuple[bool, str | None]:
    """``(True, value)`` once a GPU count by torchgpu has started the CUDA driver in this
    process, which then read CUDA_VISIBLE_DEVICES (``value``; None when unset);
    ``(False, None)`` before that."""
    if _driver_read is None:
        return False, None
    return True, None if _driver_read == _UNSET else _driver_read


def cuda_unavailable_reason() -> str:
    """Why CUDA cannot be used in this process, as one sentence with a fix; ``""`` when it can.

    Never initialises CUDA (counts GPUs through NVML, as torch.cuda.device_count does).
    """
    if torch.version.cuda is None:
        if torch.version.hip is not None:
            return f"this torch ({torch.__version__}) is a ROCm build, not a CUDA one"
        inventory = nvml.read_inventory()
        evidence = driver_evidence(inventory)
        where = f" although an NVIDIA driver is present ({evidence})" if evidence else ""
        return (
            f"this torch ({torch.__version__}) is a CPU-only build (torch.version.cuda is None)"
            f"{where}: install a CUDA build, e.g. pip install torch --index-url "
            "https://download.pytorch.org/whl/cu126"
        )
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = parse_visible_devices(raw)
    if raw is not None and not visible.ids:
        detail = f" ({visible.problem})" if visible.problem else ""
        return (
            f"CUDA_VISIBLE_DEVICES={raw!r} hides every GPU{detail}: unset it or list the "
            "GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0"
        )
    if cuda_device_count() > 0:
        return ""
    inventory = nvml.read_inventory()
    if driver_evidence(inventory) is None:
        return (
            "no NVIDIA driver was found (no NVML, no /proc/driver/nvidia, no nvidia-smi): "
            "install the driver, or use --device cpu"
        )
    if raw is not None:
        return (
            f"none of CUDA_VISIBLE_DEVICES={raw!r} names a GPU the driver has: check the "
            "ids against `torchgpu devices` or unset the variable"
        )
    return (
        "the NVIDIA driver is present but CUDA reports no usable GPU (driver too old for "
        f"CUDA {torch.version.cuda}, or the GPU is in a bad state): check nvidia-smi"
    )
