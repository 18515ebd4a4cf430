"""CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, as the CUDA driver reads them.

Pure functions, no torch and no driver calls, so every rule is table-tested;
:func:`map_nvml` applies them to the GPUs NVML lists.

What the driver does with ``CUDA_VISIBLE_DEVICES`` (the rules torch itself emulates in
``torch.cuda._parse_visible_devices``):

- Unset: every GPU is visible. Empty: none is.
- A list of ordinals is read token by token with ``strtoul``: leading whitespace is
  skipped, trailing garbage inside a token is ignored (``1gpu`` reads as ``1``), and the
  first token that does not start with a number (``""``, ``all``) or is negative ends the
  list: ``0,,1`` / ``0 1`` / ``0;1`` / ``0,-1,1`` all expose only GPU 0.
- An ordinal at or beyond the number of GPUs also ends the list (``0,7,1`` on a 2-GPU
  machine exposes GPU 0 only).
- A repeated id hides every GPU (``0,0`` exposes nothing).
- ``GPU-...`` / ``MIG-...`` UUIDs (or unambiguous prefixes of them) are opaque ids; a
  list that starts with one kind stops at the first token of another kind, and a
  prefix that matches no GPU, or several, ends the list.

Ordinals count GPUs in CUDA's enumeration order, set by ``CUDA_DEVICE_ORDER``:
``PCI_BUS_ID`` is the PCI order nvidia-smi and NVML use; the default ``FASTEST_FIRST``
puts the "fastest" GPU first by a heuristic the driver does not document. We
approximate it as: higher compute capability first, then more memory, ties in PCI order
(a GPU NVML cannot read, with unknown capability, goes last).
On machines whose GPUs are all the same model (the common case) this equals PCI order,
which is also what the driver does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torchgpu.devices.nvml import NvmlGpu

_ORDINAL = re.compile(r"^([+-]?\d+)(.*)$", re.DOTALL)
UUID_PREFIXES = ("GPU-", "MIG-")


@dataclass(frozen=True)
class VisibleDevices:
    """The result of reading a CUDA_VISIBLE_DEVICES value.

    ``raw`` is the value (None when the variable is unset). ``ids`` is what the driver
    exposes, in order: ordinals (ints) or UUIDs/UUID prefixes (strs). ``dropped`` lists
    the tokens, or pieces of tokens, the driver silently ignores. ``problem`` explains,
    in one sentence, why something was dropped (None when the value is clean).
    """

    raw: str | None
    ids: tuple[int, ...] | tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    problem: str | None = None

    @property
    def is_set(self) -> bool:
        """True when the variable is set (an empty value is set and hides every GPU)."""
        return self.raw is not None

    @property
    def kind(self) -> Literal["all", "none", "ordinal", "uuid"]:
        """``all`` (unset), ``none`` (nothing exposed), ``ordinal`` or ``uuid``."""
        if self.raw is None:
            return "all"
        if not self.ids:
            return "none"
        return "uuid" if isinstance(self.ids[0], str) else "ordinal"

    @property
    def clean(self) -> bool:
        """True when the driver reads the value exactly as written."""
        return self.problem is None and not self.dropped

    @property
    def deliberately_hides_all(self) -> bool:
        """True for the two idioms that hide every GPU on purpose: ``""`` and ``-1``."""
        return self.raw is not None and self.raw.strip() in ("", "-1")

    def as_env(self) -> str | None:
        """The value rewritten as the driver reads it (None: leave it unset)."""
        if self.raw is None:
            return None
        return ",".join(str(i) for i in self.ids)


def parse_visible_devices(value: str | None, device_count: int | None = None) -> VisibleDevices:
    """Read ``value`` the way the CUDA driver reads CUDA_VISIBLE_DEVICES.

    ``device_count`` (the number of physical GPUs, e.g. from NVML) lets ordinals past the
    last GPU end the list as the driver does; without it ordinals are not range-checked.
    Never raises: a malformed value is described in the result's ``dropped`` and
    ``problem``; :func:`validate_visible_devices` is the strict variant.
    """
    if value is None:
        return VisibleDevices(raw=None)
    if value == "":
        return VisibleDevices(raw=value)
    tokens = value.split(",")
    if value.startswith(UUID_PREFIXES):
        return _parse_uuids(value, tokens)
    return _parse_ordinals(value, tokens, device_count)


def _parse_ordinals(value: str, tokens: list[str], device_count: int | None) -> VisibleDevices:
    ids: list[int] = []
    dropped: list[str] = []
    for position, token in enumerate(tokens):
        match = _ORDINAL.match(token.strip())
        rest = tokens[position:]
        if match is None:
            why = f"token {token!r} is not a GPU ordinal"
            if token.strip().lower() == "all":
                why = "'all' is not understood by CUDA (it is an NVIDIA_VISIBLE_DEVICES value)"
            return _stopped(value, ids, rest, why)
        number = int(match.group(1))
        if number < 0:
            return _stopped(value, ids, rest, f"{number} is negative")
        if number in ids:
            return VisibleDevices(
                raw=value,
                ids=(),
                dropped=tuple(tokens),
                problem=f"GPU {number} is listed twice, and a repeated id hides every GPU",
            )
        if device_count is not None and number >= device_count:
            why = f"GPU {number} does not exist ({device_count} GPUs: 0..{device_count - 1})"
            return _stopped(value, ids, rest, why)
        garbage = match.group(2)
        if garbage:
            dropped.append(garbage)
        ids.append(number)
    problem = None
    if dropped:
        problem = "text after a number is ignored: " + ", ".join(repr(g) for g in dropped)
    return VisibleDevices(raw=value, ids=tuple(ids), dropped=tuple(dropped), problem=problem)


def _stopped(value: str, ids: list[int], rest: list[str], why: str) -> VisibleDevices:
    kept = ",".join(str(i) for i in ids) or "no GPU"
    return VisibleDevices(
        raw=value,
        ids=tuple(ids),
        dropped=tuple(rest),
        problem=f"{why}; the driver stops reading there and exposes {kept}",
    )


def _parse_uuids(value: str, tokens: list[str]) -> VisibleDevices:
    prefix = tokens[0][:4]
    ids: list[str] = []
    for position, token in enumerate(tokens):
        if token in ids:
            return VisibleDevices(
                raw=value,
                ids=(),
                dropped=tuple(tokens),
                problem=f"{token} is listed twice, and a repeated id hides every GPU",
            )
        if not token.startswith(prefix) or token == prefix:
            why = f"token {token!r} is not a {prefix} UUID like the first one"
            kept = ",".join(ids)
            return VisibleDevices(
                raw=value,
                ids=tuple(ids),
                dropped=tuple(tokens[position:]),
                problem=f"{why}; the driver stops reading there and exposes {kept}",
            )
        ids.append(token)
    return VisibleDevices(raw=value, ids=tuple(ids))


def validate_visible_devices(ids: str | Sequence[int | str]) -> str:
    """The strict form of a CUDA_VISIBLE_DEVICES value, or ValueError naming the problem.

    Accepts ``"1,2"``, ``[1, 2]``, ``["GPU-8f2a..."]``; spaces around tokens are allowed
    and removed. Refuses anything the driver would read differently from how it is
    written: empty tokens, garbage, negatives, duplicates, mixed ordinals and UUIDs.
    An empty value (hide every GPU) is allowed.
    """
    if isinstance(ids, str):
        tokens = [] if ids.strip() == "" else [t.strip() for t in ids.split(",")]
    else:
        tokens = [str(t).strip() for t in ids]
        for item in ids:
            if isinstance(item, bool) or not isinstance(item, (int, str)):
                raise ValueError(f"{item!r} is not a GPU ordinal or UUID")
    kinds = set()
    for token in tokens:
        if token.isdigit():
            kinds.add("ordinal")
        elif token.startswith(UUID_PREFIXES) and len(token) > 4:
            kinds.add("uuid")
        else:
            raise ValueError(f"{token!r} is not a GPU ordinal (0, 1, ...) or a GPU-/MIG- UUID")
    if len(kinds) > 1:
        raise ValueError("ordinals and UUIDs cannot be mixed (the driver stops at the switch)")
    canonical = [str(int(t)) if t.isdigit() else t for t in tokens]
    seen: set[str] = set()
    for token in canonical:
        if token in seen:
            raise ValueError(f"{token} is listed twice, and a repeated id hides every GPU")
        seen.add(token)
    return ",".join(canonical)


@dataclass(frozen=True)
class PhysicalGpu:
    """What the index mapping needs to know about one physical GPU (an NVML device)."""

    nvml_index: int
    uuid: str | None = None
    pci_bus_id: str | None = None
    compute_capability: tuple[int, int] | None = None
    total_bytes: int | None = None
    mig_uuids: tuple[str, ...] = field(default=())


def cuda_enumeration(gpus: Sequence[PhysicalGpu], device_order: str | None) -> list[int]:
    """NVML indices of ``gpus`` in the order CUDA numbers them before masking.

    ``PCI_BUS_ID``: PCI bus order. Anything else (unset, ``FASTEST_FIRST``): the
    approximation described in this module's docstring.
    """
    pci = sorted(gpus, key=lambda g: g.nvml_index)  # NVML enumerates in PCI order...
    if all(g.pci_bus_id for g in gpus):  # ...but trust the bus ids where all are known
        pci = sorted(gpus, key=lambda g: (str(g.pci_bus_id).lower(), g.nvml_index))
    if (device_order or "").strip().upper() == "PCI_BUS_ID":
        return [g.nvml_index for g in pci]
    # Stable sort: equal GPUs keep PCI order, as the driver keeps them.
    fastest = sorted(
        pci,
        key=lambda g: (
            tuple(-c for c in (g.compute_capability or (0, 0))),
            -(g.total_bytes or 0),
        ),
    )
    return [g.nvml_index for g in fastest]


@dataclass(frozen=True)
class VisibleTarget:
    """One GPU as torch numbers it: ``torch_index`` -> ``nvml_index`` (+ MIG instance)."""

    torch_index: int
    nvml_index: int
    cuda_ordinal: int  # the id to put in CUDA_VISIBLE_DEVICES for this GPU
    mig_uuid: str | None = None


def map_visible(
    visible: VisibleDevices, gpus: Sequence[PhysicalGpu], device_order: str | None
) -> list[VisibleTarget]:
    """Which physical GPU each torch index means, under ``visible`` and ``device_order``.

    UUID ids match by unambiguous prefix against GPU UUIDs, MIG ids against MIG instance
    UUIDs; the first id that matches nothing (or several) ends the list and a GPU
    reached twice hides every GPU, as the driver does.
    """
    order = cuda_enumeration(gpus, device_order)
    ordinal_of = {nvml: ordinal for ordinal, nvml in enumerate(order)}
    if visible.raw is None:
        return [VisibleTarget(i, nvml, i) for i, nvml in enumerate(order)]
    resolved: list[tuple[int, str | None]] = []
    for item in visible.ids:
        if isinstance(item, int):
            if item >= len(order):
                break
            target: tuple[int, str | None] = (order[item], None)
        else:
            found = _match_uuid(item, gpus)
            if found is None:
                break
            target = found
        if target in resolved:
            return []
        resolved.append(target)
    return [VisibleTarget(i, nvml, ordinal_of[nvml], mig) for i, (nvml, mig) in enumerate(resolved)]


def physical_gpus(gpus: Sequence[NvmlGpu]) -> list[PhysicalGpu]:
    """What :func:`map_visible` needs to know about NVML's GPUs."""
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


def map_nvml(
    gpus: Sequence[NvmlGpu], cuda_visible_devices: str | None, cuda_device_order: str | None
) -> list[VisibleTarget]:
    """torch's numbering of NVML's ``gpus`` under the two variables' values (None: unset):
    :func:`parse_visible_devices` (range-checked against ``len(gpus)``), then
    :func:`map_visible`. Its length is the count ``torch.cuda.device_count()`` takes
    from NVML."""
    visible = parse_visible_devices(cuda_visible_devices, device_count=len(gpus))
    return map_visible(visible, physical_gpus(gpus), cuda_device_order)


def _match_uuid(candidate: str, gpus: Sequence[PhysicalGpu]) -> tuple[int, str | None] | None:
    matches: list[tuple[int, str | None]] = []
    for gpu in gpus:
        if candidate.startswith("MIG-"):
            matches += [(gpu.nvml_index, m) for m in gpu.mig_uuids if m.startswith(candidate)]
        elif gpu.uuid is not None and gpu.uuid.startswith(candidate):
            matches.append((gpu.nvml_index, None))
    return matches[0] if len(matches) == 1 else None
