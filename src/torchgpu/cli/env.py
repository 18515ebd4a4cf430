"""``torchgpu env [--json]``: versions and variables, ready to paste into a bug report.

Versions: python, platform, torch, torch's CUDA, cuDNN, NCCL, the NVIDIA driver, NVML
and the newest CUDA the driver runs; the GPUs NVML sees; then the variables that change
device behaviour: CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER, RANK/LOCAL_RANK/WORLD_SIZE,
MASTER_ADDR/PORT, TORCHGPU_DEVICE, and every TORCH_*, PYTORCH_* and NCCL_* variable.
Never initialises CUDA: library versions are read from the libraries, GPUs from NVML.
torch's version and build are read from its files without importing it
(:mod:`torchgpu.devices.torch_build`), and torch's GPU count comes from NVML where it
can (:func:`~torchgpu.devices.cuda_status.visible_gpu_count`). Only the cuDNN and NCCL
versions of a CUDA or ROCm build need torch imported: they are those of the libraries
torch loads, which only torch can tell (a CPU-only build has neither).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

from torchgpu import __version__
from torchgpu.cli.common import ArgumentParser
from torchgpu.devices import nvml
from torchgpu.devices.cuda_status import visible_gpu_count
from torchgpu.devices.torch_build import torch_build
from torchgpu.sizes import format_bytes

NAMED_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "TORCHGPU_DEVICE",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
)
PREFIXES = ("TORCH_", "PYTORCH_", "NCCL_")


def _cudnn_version() -> str | None:
    try:
        import torch

        if not torch.backends.cudnn.is_available():  # type: ignore[no-untyped-call]
            return None
        version = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    except Exception:  # a broken torch or cuDNN install must not break a bug report
        return None
    return None if version is None else str(version)


def _nccl_version() -> str | None:
    try:
        import torch
        import torch.distributed as dist

        if torch.version.cuda is None or not dist.is_available() or not dist.is_nccl_available():
            return None
        version: Any = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except Exception:
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version)


def variables(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The variables that matter, named ones first (None = unset), then prefixed ones."""
    env = os.environ if environ is None else environ
    found: dict[str, str | None] = {name: env.get(name) for name in NAMED_VARIABLES}
    for name in sorted(env):
        if name.startswith(PREFIXES) and name not in found:
            found[name] = env[name]
    return found


def collect() -> dict[str, Any]:
    """Everything ``torchgpu env`` prints."""
    inventory = nvml.read_inventory()
    build = torch_build()
    versions: dict[str, str | None] = {
        "torchgpu": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": build.version,
        "torch CUDA": build.cuda,
        # A CPU-only build has neither library, so torch need not be imported to say so.
        "cuDNN": None if build.cpu_only else _cudnn_version(),
        "NCCL": None if build.cpu_only else _nccl_version(),
        "driver": inventory.driver_version,
        "NVML": inventory.nvml_version if inventory.available else inventory.error,
        "driver CUDA": inventory.cuda_driver_version,
    }
    gpus = [
        f"{g.nvml_index}: {g.name or '?'} ({format_bytes(g.total_bytes)})"
        + (f" ERROR {g.error}" if g.error else "")
        for g in inventory.gpus
    ]
    return {
        "versions": versions,
        "gpus": gpus,
        # Counts through NVML where it can; never creates a CUDA context.
        "torch_device_count": visible_gpu_count(),
        "variables": variables(),
    }


def format_report(data: dict[str, Any]) -> str:
    """Plain text, aligned, inside a Markdown code fence for pasting."""
    lines = ["```"]
    width = max(len(k) for k in [*data["versions"], *data["variables"]]) + 1
    for key, value in data["versions"].items():
        lines.append(f"{key + ':':<{width}} {value if value is not None else '-'}")
    lines.append(f"{'GPUs (NVML):':<{width}} {len(data['gpus'])}")
    lines += [f"  {g}" for g in data["gpus"]]
    lines.append(f"{'torch sees:':<{width}} {data['torch_device_count']} GPU(s)")
    lines.append("variables:")
    for key, value in data["variables"].items():
        lines.append(f"  {key}={value if value is not None else '(unset)'}")
    lines.append("```")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(prog="torchgpu env", description="Versions and variables.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    data = collect()
    print(json.dumps(data, indent=2) if args.json else format_report(data))
    return 0
