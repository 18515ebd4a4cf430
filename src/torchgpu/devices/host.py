"""The host's CPU: its name, logical cores and RAM, read without torch.

Linux reads ``/proc/cpuinfo`` and ``/proc/meminfo``; elsewhere the name comes from
:mod:`platform` and the memory figures are None. Never raises.
"""

from __future__ import annotations

import contextlib
import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class HostInfo:
    """The CPU's name, logical core count and RAM in bytes (None where unknown)."""

    cpu_name: str
    cores: int | None
    total_bytes: int | None
    available_bytes: int | None


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` as ``{key: bytes}`` (empty where the file cannot be read)."""
    values: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024  # the file says kB, meaning KiB
    return values


def cpu_name() -> str:
    """The CPU model (``/proc/cpuinfo``'s "model name"), else what :mod:`platform` says."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "CPU"


def host_info() -> HostInfo:
    """This machine's CPU name, cores and RAM (total and available)."""
    memory = meminfo()
    return HostInfo(
        cpu_name=cpu_name(),
        cores=os.cpu_count(),
        total_bytes=memory.get("MemTotal"),
        available_bytes=memory.get("MemAvailable"),
    )
