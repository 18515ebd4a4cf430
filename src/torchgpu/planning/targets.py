"""Which devices a plan is for: this machine's, or hypothetical ones described by size.

:func:`parse_devices` accepts

- ``auto``: this machine's devices (:func:`torchgpu.devices.list_devices`): its GPUs if
  torch can use any, else the CPU with its RAM (MPS, which shares RAM, counts its RAM);
- ``NxSIZE`` items, comma-separated: ``4x80GiB``, ``2x24GiB,1x16GiB``, ``80GB`` (one);
- real device specs, comma-separated: ``cuda:0,cuda:1``, ``cpu``.

Usable memory is the device's memory less a headroom fraction (:data:`HEADROOM`, 10%)
kept for what the estimate does not count: the CUDA context, cuDNN/cuBLAS workspaces
and the caching allocator's fragmentation. For real devices the starting point is what
is free now (other processes' memory is not ours); for hypothetical ones, the size given.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchgpu.errors import UsageError
from torchgpu.sizes import parse_size

#: Fraction of each device's memory a plan leaves unused (context, workspaces, fragmentation).
HEADROOM = 0.10

ACCEPTED = (
    "auto (this machine's devices), NxSIZE items such as 4x80GiB or 2x24GiB,1x16GiB "
    "(hypothetical devices; SIZE like 80GiB, 24GB, 16G), or real devices such as "
    "cuda:0,cuda:1 or cpu"
)
_COUNT_SIZE = re.compile(r"^(?:(\d+)\s*[x*]\s*)?(\d+(?:\.\d+)?\s*[A-Za-z]*)$")
_REAL = re.compile(r"^(cpu|mps|cuda:\d+)$")


@dataclass(frozen=True)
class DeviceTarget:
    """One device a plan places work on.

    ``name`` is how the table and the command refer to it (``cuda:0``, ``cpu``, or
    ``gpu0`` for a hypothetical device); ``kind`` is ``cuda``, ``mps`` or ``cpu``;
    ``memory_bytes`` the memory counted (free memory for real devices, the given size
    for hypothetical ones); ``usable_bytes`` what a plan may fill (``memory_bytes`` less
    the headroom); ``real`` whether it exists on this machine.
    """

    name: str
    kind: str
    memory_bytes: int
    usable_bytes: int
    real: bool

    @classmethod
    def of(
        cls, name: str, kind: str, memory_bytes: int, real: bool, headroom: float = HEADROOM
    ) -> DeviceTarget:
        """A target whose usable memory is ``memory_bytes * (1 - headroom)``."""
        return cls(name, kind, memory_bytes, int(memory_bytes * (1.0 - headroom)), real)


def _bad(spec: str, why: str) -> UsageError:
    return UsageError(f"--devices {spec!r} is not understood: {why}. Use {ACCEPTED}.")

#: The most devices a plan is made for.
MAX_DEVICES = 1024


def parse_devices(
    spec: str,
    inventory: Callable[[], Sequence[object]] | None = None,
    headroom: float = HEADROOM,
) -> list[DeviceTarget]:
    """The devices ``spec`` describes (forms in the module docstring).

    ``inventory`` returns this machine's :class:`torchgpu.devices.DeviceInfo` list (default
    :func:`torchgpu.devices.list_devices`); it is only called for ``auto`` and real specs,
    so hypothetical plans never look at the machine. Raises :class:`UsageError` naming the
    bad value and the accepted forms, or the devices that exist when a real one is missing.
    """
    text = spec.strip()
    if not text:
        raise _bad(spec, "it is empty")
    items = [item.strip() for item in text.split(",")]
    if any(not item for item in items):
        raise _bad(spec, "it has an empty item between commas")
    if text.lower() == "auto":
        return _auto(_load_inventory(inventory), headroom)
    targets: list[DeviceTarget] = []
    hypothetical = 0
    infos: Sequence[object] | None = None
    for item in items:
        if _REAL.match(item.lower()):
            if infos is None:
                infos = _load_inventory(inventory)
            targets.append(_real(item.lower(), infos, spec, headroom))
            continue
        count, size = _count_and_size(item, spec)
        if len(targets) + count > MAX_DEVICES:  # before building them: 10**12 would hang
            raise _bad(spec, f"it describes {len(targets) + count} or more devices; plans "
                       f"are for at most {MAX_DEVICES}")
        for _ in range(count):
            targets.append(DeviceTarget.of(f"gpu{hypothetical}", "cuda", size, False, headroom))
            hypothetical += 1
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise _bad(spec, "it names the same device twice")
    if len(targets) > MAX_DEVICES:
        raise _bad(spec, f"it describes {len(targets)} devices; plans are for at most "
                   f"{MAX_DEVICES}")
    return targets


def _count_and_size(item: str, spec: str) -> tuple[int, int]:
    match = _COUNT_SIZE.match(item)
    if match is None:
        raise _bad(spec, f"item {item!r} is neither NxSIZE nor a device such as cuda:0")
    count = int(match.group(1)) if match.group(1) is not None else 1
    if count < 1:
        raise _bad(spec, f"item {item!r} asks for {count} devices; the count must be at least 1")
    try:
        size = parse_size(match.group(2))
    except UsageError:
        raise _bad(spec, f"item {item!r} has no size such as 80GiB") from None
    if size < 1024**2:
        raise _bad(
            spec, f"item {item!r} gives {size} bytes per device; a size needs a unit such as GiB"
        )
    return count, size


def _load_inventory(inventory: Callable[[], Sequence[object]] | None) -> Sequence[object]:
    if inventory is not None:
        return inventory()
    from torchgpu.devices import list_devices

    return list_devices()


def _memory(info: object) -> int | None:
    free = getattr(info, "free_bytes", None)
    total = getattr(info, "total_bytes", None)
    value = free if free is not None else total
    return int(value) if value is not None else None


def _cpu_ram(infos: Sequence[object]) -> int | None:
    for info in infos:
        if getattr(info, "kind", None) == "cpu":
            return _memory(info)
    return None


def _target_for(info: object, infos: Sequence[object], headroom: float) -> DeviceTarget | None:
    kind = str(getattr(info, "kind", ""))
    index = getattr(info, "index", None)
    name = f"cuda:{index}" if kind == "cuda" else kind
    memory = _cpu_ram(infos) if kind == "mps" else _memory(info)  # MPS shares system RAM
    if memory is None or getattr(info, "error", None):
        return None
    return DeviceTarget.of(name, kind, memory, True, headroom)


def _auto(infos: Sequence[object], headroom: float) -> list[DeviceTarget]:
    for wanted in ("cuda", "mps", "cpu"):
        chosen = [
            t
            for i in infos
            if getattr(i, "kind", None) == wanted
            if (t := _target_for(i, infos, headroom))
        ]
        if wanted == "cuda" and chosen and not _torch_cuda_usable():
            chosen = []  # NVML sees GPUs this torch build cannot use: plan for what can run
        if chosen:
            return chosen
    raise UsageError(
        "--devices auto found no device with a known memory size on this machine: name "
        f"hypothetical devices instead, e.g. --devices 1x16GiB. Accepted: {ACCEPTED}."
    )


def _torch_cuda_usable() -> bool:
    import torch

    return torch.version.cuda is not None and torch.cuda.is_available()


def _real(name: str, infos: Sequence[object], spec: str, headroom: float) -> DeviceTarget:
    for info in infos:
        kind = getattr(info, "kind", None)
        index = getattr(info, "index", None)
        if (f"cuda:{index}" if kind == "cuda" else kind) == name:
            target = _target_for(info, infos, headroom)
            if target is None:
                raise UsageError(
                    f"--devices {spec!r}: {name} exists but its memory size cannot be read; "
                    "name its size instead, e.g. --devices 1x24GiB."
                )
            return target
    present = [
        f"cuda:{getattr(i, 'index', '?')}"
        if getattr(i, "kind", None) == "cuda"
        else str(getattr(i, "kind", "?"))
        for i in infos
    ]
    raise UsageError(
        f"--devices {spec!r}: {name} is not on this machine (devices here: "
        f"{', '.join(present) or 'none'}). Use one of those, or plan for hypothetical devices "
        "with NxSIZE such as 2x24GiB."
    )
