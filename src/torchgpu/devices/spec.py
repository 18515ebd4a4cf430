"""Which torch.device a spec names: :func:`get_device` (the device to train on),
:func:`placement_device` (any device to move or allocate on) and :func:`default_device`.

Validated when called, not at first use, and never initialising CUDA: GPU indices are
checked against the count torch takes from NVML (:mod:`torchgpu.devices.cuda_status`).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import torch

from torchgpu.devices.cuda_status import (
    cuda_device_count,
    cuda_initialized,
    cuda_unavailable_reason,
)
from torchgpu.devices.torch_build import mps_available
from torchgpu.errors import DeviceSpecError, NoDeviceError

ACCEPTED_SPECS = "auto, cpu, cuda, cuda:N, N (a GPU index) or mps"
_SPEC = re.compile(r"^(auto|cpu|cuda|mps|cuda:(0|[1-9]\d*)|(0|[1-9]\d*))$")


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
        if not mps_available():
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
    if cuda_initialized():
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
    if mps_available():
        return torch.device("mps")
    return torch.device("cpu")


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
