"""``torchgpu devices [--json] [--watch SECONDS]``: what nvidia-smi shows, plus torch's view.

Prints one row per GPU in torch's numbering (with nvidia-smi's index beside it, so
CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER surprises show), the MPS row where present,
and the CPU row. On a machine where torch cannot use a GPU, one line says why.
Never initialises CUDA unless NVML is unavailable (then torch is asked instead), and
never imports torch when NVML is available or torch is a CPU-only build: torch's
version and build are read from its files (:mod:`torchgpu.devices.torch_build`), the
GPUs from NVML in torch's numbering. ``--watch`` reads NVML again each time; nothing
is imported again.

``--json`` prints one object (with ``--watch``: one object per line, per refresh).
Its schema is :data:`JSON_SCHEMA`, which ``torchgpu devices --help`` prints too; it is
stable: new keys may be added, existing ones keep their meaning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from collections.abc import Callable
from typing import TypedDict

from rich.console import Console
from rich.table import Table

from torchgpu.cli.common import ArgumentParser, fail
from torchgpu.console import make_console
from torchgpu.devices import nvml
from torchgpu.devices.cuda_status import cuda_unavailable_reason
from torchgpu.devices.info import DeviceInfo
from torchgpu.devices.listing import list_devices
from torchgpu.devices.torch_build import torch_build
from torchgpu.sizes import format_bytes

SCHEMA_VERSION = 1
JSON_SCHEMA = """\
{
  "schema": 1,
  "torch": {"version": str, "cuda": str | null,          # torch.version.cuda
            "cuda_usable": bool, "cuda_unavailable_reason": str | null},
  "nvml": {"available": bool, "error": str | null, "driver_version": str | null,
           "nvml_version": str | null, "cuda_driver_version": str | null},
  "cuda_visible_devices": str | null,   # the variable as set; null = unset
  "cuda_device_order": str | null,
  "devices": [{
    "kind": "cuda" | "mps" | "cpu", "spec": str,          # "cuda:0", "cpu": for --device
    "index": int | null,            # torch's index (null for cpu/mps)
    "nvml_index": int | null,       # nvidia-smi's index
    "cuda_ordinal": int | null,     # the id for a fresh CUDA_VISIBLE_DEVICES
    "name": str | null, "uuid": str | null, "pci_bus_id": str | null,
    "total_bytes": int | null, "free_bytes": int | null, "used_bytes": int | null,
    "allocated_bytes": int | null, "reserved_bytes": int | null,   # this process's torch
    "compute_capability": [int, int] | null, "bf16_supported": bool | null,
    "utilization_pct": int | null, "temperature_c": int | null,
    "power_w": float | null, "power_limit_w": float | null,
    "mig": bool | null, "cores": int | null,     # cores: cpu only
    "error": str | null,                          # e.g. "GPU is lost"
    "processes": [{"pid": int, "name": str | null, "user": str | null,
                   "used_bytes": int | null}] | null      # null = unknown
  }]
}
Every value may be null where the device or NVML cannot tell.
"""
MAX_WATCH_S = 86400.0  # a day; larger values are typos (and inf overflows time.sleep)


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="torchgpu devices",
        description="List GPUs (torch's numbering and nvidia-smi's), MPS and the CPU.",
        epilog="--json prints one object (one per line with --watch) in this stable "
        "schema; new keys may be added, existing ones keep their meaning:\n\n" + JSON_SCHEMA,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "--watch", type=float, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C"
    )
    return parser


class ProcessRecord(TypedDict):
    """A process holding GPU memory, in the ``--json`` schema."""

    pid: int
    name: str | None
    user: str | None
    used_bytes: int | None


class DeviceRecord(TypedDict):
    """One device in the ``--json`` schema: :class:`DeviceInfo`'s fields and its spec."""

    kind: str
    index: int | None
    name: str | None
    total_bytes: int | None
    free_bytes: int | None
    used_bytes: int | None
    uuid: str | None
    pci_bus_id: str | None
    nvml_index: int | None
    cuda_ordinal: int | None
    allocated_bytes: int | None
    reserved_bytes: int | None
    compute_capability: list[int] | None
    bf16_supported: bool | None
    utilization_pct: int | None
    temperature_c: int | None
    power_w: float | None
    power_limit_w: float | None
    processes: list[ProcessRecord] | None
    mig: bool | None
    cores: int | None
    error: str | None
    spec: str


class TorchRecord(TypedDict):
    version: str
    cuda: str | None
    cuda_usable: bool
    cuda_unavailable_reason: str | None


class NvmlRecord(TypedDict):
    available: bool
    error: str | None
    driver_version: str | None
    nvml_version: str | None
    cuda_driver_version: str | None


class Snapshot(TypedDict):
    """Everything ``devices --json`` prints (see :data:`JSON_SCHEMA`)."""

    schema: int
    torch: TorchRecord
    nvml: NvmlRecord
    cuda_visible_devices: str | None
    cuda_device_order: str | None
    devices: list[DeviceRecord]


def device_dict(device: DeviceInfo) -> DeviceRecord:
    """One device in the ``--json`` schema."""
    cc, processes = device.compute_capability, device.processes
    return {
        "kind": device.kind, "index": device.index, "name": device.name,
        "total_bytes": device.total_bytes, "free_bytes": device.free_bytes,
        "used_bytes": device.used_bytes, "uuid": device.uuid, "pci_bus_id": device.pci_bus_id,
        "nvml_index": device.nvml_index, "cuda_ordinal": device.cuda_ordinal,
        "allocated_bytes": device.allocated_bytes, "reserved_bytes": device.reserved_bytes,
        "compute_capability": list(cc) if cc is not None else None,
        "bf16_supported": device.bf16_supported, "utilization_pct": device.utilization_pct,
        "temperature_c": device.temperature_c, "power_w": device.power_w,
        "power_limit_w": device.power_limit_w,
        "processes": None if processes is None else [
            {"pid": p.pid, "name": p.name, "user": p.user, "used_bytes": p.used_bytes}
            for p in processes
        ],
        "mig": device.mig, "cores": device.cores, "error": device.error, "spec": device.spec,
    }  # fmt: skip


def snapshot() -> Snapshot:
    """Everything ``devices --json`` prints, as a dict."""
    inventory = nvml.read_inventory()
    reason = cuda_unavailable_reason()
    build = torch_build()
    return {
        "schema": SCHEMA_VERSION,
        "torch": {
            "version": build.version,
            "cuda": build.cuda,
            "cuda_usable": not reason,
            "cuda_unavailable_reason": reason or None,
        },
        "nvml": {
            "available": inventory.available,
            "error": inventory.error,
            "driver_version": inventory.driver_version,
            "nvml_version": inventory.nvml_version,
            "cuda_driver_version": inventory.cuda_driver_version,
        },
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        # init_cuda only matters without NVML; this process exits right after.
        "devices": [device_dict(d) for d in list_devices(init_cuda=True)],
    }


def _num(value: object, unit: str = "", fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value) + unit


def _processes(device: DeviceRecord) -> str:
    processes = device["processes"]
    if processes is None:
        return "-"
    if not processes:
        return "none"
    shown = [
        f"{p['pid']} {p['name'] or '?'} ({p['user'] or '?'}, {format_bytes(p['used_bytes'])})"
        for p in processes[:3]
    ]
    more = f" +{len(processes) - 3}" if len(processes) > 3 else ""
    return "; ".join(shown) + more


def _memory(device: DeviceRecord) -> str:
    used, total = device["used_bytes"], device["total_bytes"]
    if used is None and total is None:
        return "-"
    return f"{format_bytes(used)} / {format_bytes(total)}"


def build_table(data: Snapshot) -> Table:
    """The human view of a :func:`snapshot`."""
    table = Table(title="devices (torch numbering; smi = nvidia-smi's index)")
    for column in (
        "device",
        "smi",
        "name",
        "used / total",
        "free",
        "util",
        "temp",
        "power",
        "cc",
        "bf16",
        "torch alloc/resv",
        "processes",
    ):
        table.add_column(column, overflow="fold")
    for d in data["devices"]:
        name = d["name"] or "?"
        if d["kind"] == "cpu":
            name = f"{name} ({_num(d['cores'])} cores)"
        if d["error"]:
            name += f" [ERROR: {d['error']}]"
        cc = d["compute_capability"]
        power = "-"
        if d["power_w"] is not None:
            power = f"{d['power_w']:.0f}" + (
                f"/{d['power_limit_w']:.0f} W" if d["power_limit_w"] is not None else " W"
            )
        torch_mem = "-"
        if d["allocated_bytes"] is not None:
            torch_mem = f"{format_bytes(d['allocated_bytes'])}/{format_bytes(d['reserved_bytes'])}"
        table.add_row(
            d["spec"] + (" MIG" if d["mig"] else ""),
            _num(d["nvml_index"]),
            name,
            _memory(d),
            format_bytes(d["free_bytes"]),
            _num(d["utilization_pct"], "%"),
            _num(d["temperature_c"], " C"),
            power,
            f"{cc[0]}.{cc[1]}" if cc else "-",
            {True: "yes", False: "no", None: "-"}[d["bf16_supported"]],
            torch_mem,
            _processes(d) if d["kind"] == "cuda" else "-",
        )
    return table


def _notes(data: Snapshot) -> list[str]:
    notes = []
    gpus = [d for d in data["devices"] if d["kind"] == "cuda"]
    reason = data["torch"]["cuda_unavailable_reason"]
    if not gpus:
        why = reason or data["nvml"]["error"] or "the driver reports no GPU"
        notes.append(f"No CUDA GPU: {why}")
    elif reason:
        notes.append(f"torch cannot use these GPUs: {reason}")
    nv = data["nvml"]
    if nv["available"]:
        notes.append(
            f"driver {nv['driver_version'] or '?'}, NVML {nv['nvml_version'] or '?'}, "
            f"CUDA driver API {nv['cuda_driver_version'] or '?'}; "
            f"torch {data['torch']['version']} (CUDA {data['torch']['cuda'] or 'none'})"
        )
    for name in ("cuda_visible_devices", "cuda_device_order"):
        if data[name] is not None:
            notes.append(f"{name.upper()}={data[name]}")
    return notes


def render(data: Snapshot, console: Console) -> None:
    """Print the table and notes of ``data`` on ``console``."""
    console.print(build_table(data))
    for note in _notes(data):
        console.print(note, highlight=False, markup=False, soft_wrap=True)


def run(
    json_output: bool,
    watch_s: float | None,
    *,
    iterations: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
    collect: Callable[[], Snapshot] = snapshot,
) -> int:
    """The verb's body. ``iterations`` bounds ``--watch`` (for tests); None = until Ctrl-C."""
    console = make_console()
    done = 0
    try:
        while True:
            data = collect()
            if json_output:
                indent = None if watch_s is not None else 2
                print(json.dumps(data, sort_keys=True, indent=indent), flush=True)
            else:
                if watch_s is not None and console.is_terminal:
                    console.clear()
                render(data, console)
                if watch_s is not None:
                    console.print(f"refreshing every {watch_s:g} s; Ctrl-C to stop", style="dim")
            done += 1
            if watch_s is None or (iterations is not None and done >= iterations):
                return 0
            sleep(watch_s)
    except KeyboardInterrupt as stop:
        if getattr(stop, "signum", signal.SIGINT) != signal.SIGINT:
            raise  # SIGTERM (torchgpu.cli.signals.Stopped): a stop, not the way out
        return 0  # Ctrl-C: the normal way to leave --watch


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    watch = args.watch
    if watch is not None and not (math.isfinite(watch) and 0 < watch <= MAX_WATCH_S):
        return fail(
            f"--watch {watch:g} must be a positive number of seconds up to "
            f"{MAX_WATCH_S:g} (a day), e.g. --watch 2"
        )
    return run(args.json, args.watch)
