"""Choosing GPUs from inside a script: :func:`set_visible_devices`.

The driver reads CUDA_VISIBLE_DEVICES once, when it starts, so setting the variable is
only useful before that; this module checks the value strictly and says when it is too
late (CUDA initialised) or only reaches child processes (the driver already counted).
"""

from __future__ import annotations

import os
import warnings

from torchgpu.devices import nvml
from torchgpu.devices.cuda_status import cuda_initialized, driver_read_visible_devices
from torchgpu.devices.visible import validate_visible_devices
from torchgpu.errors import VisibleDevicesError


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
    if cuda_initialized():
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
