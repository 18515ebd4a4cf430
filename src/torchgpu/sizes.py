"""Byte sizes: parsing what people type (``8GiB``, ``500MB``) and printing them back."""

from __future__ import annotations

import re

from torchgpu.errors import UsageError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp](?:ib|i|b)?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
_LARGEST = 2**63 - 1  # bytes: anything larger overflows the int64 sizes torch and NVML use
for _power, _letter in enumerate("kmgtp", start=1):
    _UNITS[_letter] = _UNITS[_letter + "ib"] = _UNITS[_letter + "i"] = 1024**_power
    _UNITS[_letter + "b"] = 1000**_power


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``1024``, ``500MB`` (10^6), ``8GiB`` / ``8G`` (2^30), ``1.5TB``.

    Case does not matter. Raises UsageError for anything else, naming a negative size
    as such.
    """
    match = _SIZE.match(text)
    if match is None and text.strip().startswith("-") and _SIZE.match(text.strip()[1:]):
        raise UsageError(
            f"size {text!r} is negative: a size must be >= 0, e.g. 0, 500MB or 8GiB"
        )
    if match is None:
        raise UsageError(
            f"size {text!r} is not understood: use a number of bytes with an optional unit, "
            "e.g. 1024, 500MB, 8GiB (B, KB/MB/GB/TB = powers of 1000; KiB/MiB/GiB/TiB, "
            "K/M/G/T = powers of 1024)"
        )
    value = float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
    if value > _LARGEST:
        raise UsageError(
            f"size {text!r} is out of range: sizes up to {_LARGEST} bytes (8 EiB) are "
            "accepted, e.g. 500MB or 8GiB"
        )
    return int(value)


def format_bytes(n: int | None) -> str:
    """``n`` bytes as a short human string in binary units (``79.6 GiB``); ``-`` for None."""
    if n is None:
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover - loop always returns
