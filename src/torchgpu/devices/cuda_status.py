"""Whether CUDA can be used in this process, and counting GPUs without initialising it.

- :func:`cuda_initialized` is the one check for "has this process started CUDA": it never
  starts it, and never imports torch (a process that has not imported torch has not
  started CUDA through it).
- :func:`cuda_unavailable_reason` says, in one sentence with a fix, why CUDA cannot be
  used here (CPU-only build, no driver, CUDA_VISIBLE_DEVICES hiding every GPU...).
- :func:`cuda_device_count` is ``torch.cuda.device_count()`` that also remembers when
  the count had to go through the CUDA driver. torch counts through NVML when it can
  (no CUDA context, CUDA_VISIBLE_DEVICES still free to change); when NVML discovery
  fails, or CUDA_VISIBLE_DEVICES names ``MIG-`` instances, it falls back to
  ``cudaGetDeviceCount``, which starts the driver, and the driver reads
  CUDA_VISIBLE_DEVICES at that moment, once. :func:`driver_read_visible_devices` tells
  :func:`torchgpu.devices.set_visible_devices` that a later change would not apply here.
- :func:`visible_gpu_count` is the same count without importing torch where the answer
  does not need it (a CPU-only build; NVML available): ``torchgpu devices`` and
  ``select`` stay fast.

torch is imported inside the functions that need it, so importing this module is cheap.
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings
from collections.abc import Callable

from torchgpu.devices import nvml
from torchgpu.devices.torch_build import torch_build, torch_loaded
from torchgpu.devices.visible import map_nvml, parse_visible_devices

_UNSET = "<unset>"
# The CUDA_VISIBLE_DEVICES value the driver read when torchgpu's count went through it
# (_UNSET when the variable was unset); None while that has not happened.
_driver_read: str | None = None


def cuda_initialized() -> bool:
    """Whether this process has started CUDA. Never starts it, never imports torch."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    # torch.cuda.is_initialized is untyped in some torch releases; the alias types it.
    check: Callable[[], bool] = torch.cuda.is_initialized
    return bool(check())


def driver_evidence(inventory: nvml.NvmlInventory | None = None) -> str | None:
    """Where we see an NVIDIA driver (without CUDA): NVML, /proc, or nvidia-smi on PATH."""
    if inventory is not None and inventory.available and inventory.gpus:
        return f"NVML lists {len(inventory.gpus)} GPU(s)"
    if os.path.exists("/proc/driver/nvidia/version"):
        return "/proc/driver/nvidia/version exists"
    if shutil.which("nvidia-smi"):
        return "nvidia-smi is on PATH"
    return None


def count_goes_through_driver() -> bool:
    """True when ``torch.cuda.device_count()`` would ask the CUDA driver, not NVML.

    Mirrors torch's own choice: a torch compiled without CUDA never asks; ``MIG-`` ids
    in CUDA_VISIBLE_DEVICES always do; otherwise torch's NVML count failing (< 0) does.
    """
    import torch

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
    import torch

    global _driver_read
    through_driver = (
        _driver_read is None
        and torch.version.cuda is not None
        and not cuda_initialized()
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


def visible_gpu_count() -> int:
    """The number ``torch.cuda.device_count()`` gives in this process, asking torch only
    when the answer needs it.

    Once torch is imported, torch answers (:func:`cuda_device_count`). Before, a CPU-only
    build counts no GPU, and a CUDA build with NVML available counts NVML's GPUs as
    CUDA_VISIBLE_DEVICES maps them (:func:`torchgpu.devices.visible.map_nvml`), which is
    how torch itself counts through NVML. Otherwise torch is imported and asked. Never
    initialises CUDA.
    """
    if not torch_loaded():
        build = torch_build()
        if build.cpu_only:
            return 0
        if build.cuda is not None:
            inventory = nvml.read_inventory()
            if inventory.available:
                return len(
                    map_nvml(
                        inventory.gpus,
                        os.environ.get("CUDA_VISIBLE_DEVICES"),
                        os.environ.get("CUDA_DEVICE_ORDER"),
                    )
                )
    return cuda_device_count()


def cuda_unavailable_reason() -> str:
    """Why CUDA cannot be used in this process, as one sentence with a fix; ``""`` when it can.

    Never initialises CUDA (counts GPUs through NVML, as torch.cuda.device_count does),
    and imports torch only when the count needs it (see :func:`visible_gpu_count`).
    """
    build = torch_build()
    if build.cuda is None:
        if build.hip is not None:
            return f"this torch ({build.version}) is a ROCm build, not a CUDA one"
        inventory = nvml.read_inventory()
        evidence = driver_evidence(inventory)
        where = f" although an NVIDIA driver is present ({evidence})" if evidence else ""
        return (
            f"this torch ({build.version}) is a CPU-only build (torch.version.cuda is None)"
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
    if visible_gpu_count() > 0:
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
        f"CUDA {build.cuda}, or the GPU is in a bad state): check nvidia-smi"
    )
