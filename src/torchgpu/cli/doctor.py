"""``torchgpu doctor``: the environment pitfalls users hit, each with its fix.

Checks: CUDA_VISIBLE_DEVICES malformed or silently truncated (or naming GPUs that do
not exist); CUDA_DEVICE_ORDER not PCI_BUS_ID while the GPUs differ (torch's indices
then differ from nvidia-smi's); an NVIDIA driver with a CPU-only torch; a CUDA torch
without NCCL; a driver too old for torch's CUDA; GPUs that cannot be read; a GPU almost
full or used by other processes; MIG mode. Exit 0 when clean, 1 when something was
found. Never initialises CUDA.

``torchgpu doctor --model module:factory --input-shape 2,3,128,128 [--devices
cuda:0,cuda:1]`` instead runs the fake-device placement check of
:func:`torchgpu.placement.check_placement` (:mod:`.doctor_placement`) and exits 0 when
the placement is sound, 1 when a module or tensor is on the wrong device, 2 when it could
not check (the factory raised, or the forward failed for another reason, such as a wrong
--input-shape).

The checks are a pure function, :func:`find_problems`, over an :class:`EnvSnapshot`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from torchgpu.cli.common import ArgumentParser
from torchgpu.cli.doctor_placement import check_model_placement
from torchgpu.devices import nvml
from torchgpu.devices.cuda_status import cuda_device_count, driver_evidence
from torchgpu.devices.visible import (
    UUID_PREFIXES,
    PhysicalGpu,
    VisibleTarget,
    map_visible,
    parse_visible_devices,
    physical_gpus,
)
from torchgpu.errors import UsageError
from torchgpu.sizes import format_bytes

FULL_FRACTION = 0.9  # a GPU with this share of its memory used is "almost full"


@dataclass(frozen=True)
class EnvSnapshot:
    """What the checks look at; :func:`take_snapshot` reads it from this machine."""

    torch_version: str = "0"
    torch_cuda: str | None = None  # torch.version.cuda
    torch_hip: str | None = None
    nccl_available: bool | None = None  # None: not asked (not a CUDA build)
    torch_device_count: int = 0
    inventory: nvml.NvmlInventory = field(default_factory=nvml.NvmlInventory)
    driver_evidence: str | None = None  # where a driver was seen, None if nowhere
    cuda_visible_devices: str | None = None
    cuda_device_order: str | None = None
    own_pids: frozenset[int] = frozenset()  # processes that are us, not "others"


@dataclass(frozen=True)
class Finding:
    """One problem: a stable ``code``, what is wrong, and how to fix it."""

    code: str
    message: str
    fix: str


def take_snapshot() -> EnvSnapshot:
    """Read this machine: torch build, NVML, driver traces and the variables."""
    import torch  # here, not at the top: a mistyped flag or --help answers without it


    nccl: bool | None = None
    if torch.version.cuda is not None:
        import torch.distributed as dist

        nccl = dist.is_available() and dist.is_nccl_available()
    inventory = nvml.read_inventory()
    return EnvSnapshot(
        torch_version=str(torch.__version__),
        torch_cuda=torch.version.cuda,
        torch_hip=torch.version.hip,
        nccl_available=nccl,
        torch_device_count=cuda_device_count(),
        inventory=inventory,
        driver_evidence=driver_evidence(inventory),
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        cuda_device_order=os.environ.get("CUDA_DEVICE_ORDER"),
        own_pids=frozenset({os.getpid(), os.getppid()}),
    )


def _version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = re.findall(r"\d+", text)[:2]
    return tuple(int(p) for p in parts) if parts else None


def _resolve(token: str, s: EnvSnapshot) -> VisibleTarget | None:
    """The GPU ``token`` alone would select (None when the inventory cannot tell)."""
    gpus = s.inventory.gpus
    if not gpus:
        return None
    alone = parse_visible_devices(token, device_count=len(gpus))
    mapped = map_visible(alone, _physical(s), s.cuda_device_order)
    return mapped[0] if len(mapped) == 1 else None


def _convert(token: str, kind: str, s: EnvSnapshot) -> str | None:
    """``token`` rewritten in the list's ``kind`` (``ordinal``, ``GPU-`` or ``MIG-``)
    through the inventory, or None when it cannot be."""
    target = _resolve(token, s)
    if target is None or target.mig_uuid is not None:
        return None  # unknown, or a MIG instance: no whole-GPU id selects it
    if kind == "ordinal":
        return str(target.cuda_ordinal)
    if kind == "GPU-":
        by_index = {g.nvml_index: g for g in s.inventory.gpus}
        return by_index[target.nvml_index].uuid
    return None


def _suggest_visible(raw: str, s: EnvSnapshot) -> str:
    """What the user most likely meant: every id-looking token, once, in order, all of
    the first token's kind (the driver stops at a change of kind). Tokens of another
    kind are converted through the inventory where it knows the GPU, else dropped."""
    tokens = re.findall(r"(?:GPU|MIG)-[0-9A-Za-z/\-]+|\d+", raw)
    if not tokens:
        return ""
    count = len(s.inventory.gpus) or None
    kind = tokens[0][:4] if tokens[0].startswith(UUID_PREFIXES) else "ordinal"
    kept: list[str] = []
    reached: list[tuple[int, str | None]] = []  # GPUs already selected, to drop repeats
    for token in tokens:
        if token.isdigit():
            token = str(int(token))
            if count is not None and int(token) >= count:
                continue
        token_kind = token[:4] if token.startswith(UUID_PREFIXES) else "ordinal"
        if token_kind != kind:
            converted = _convert(token, kind, s)
            if converted is None:
                continue
            token = converted
        target = _resolve(token, s)
        gpu = None if target is None else (target.nvml_index, target.mig_uuid)
        if token in kept or (gpu is not None and gpu in reached):
            continue
        kept.append(token)
        if gpu is not None:
            reached.append(gpu)
    return ",".join(kept)


def _visible_findings(s: EnvSnapshot) -> list[Finding]:
    raw = s.cuda_visible_devices
    if raw is None:
        return []
    gpus = s.inventory.gpus
    count = len(gpus) if gpus else None
    visible = parse_visible_devices(raw, device_count=count)
    if not visible.clean and not visible.deliberately_hides_all:
        meant = _suggest_visible(raw, s)
        fix = f"export CUDA_VISIBLE_DEVICES={meant}" if meant else "unset CUDA_VISIBLE_DEVICES"
        return [
            Finding(
                "visible-devices",
                f"CUDA_VISIBLE_DEVICES={raw!r} is read by the driver as "
                f"{visible.as_env()!r}: {visible.problem}.",
                f"{fix} (comma-separated ordinals or GPU-/MIG- UUIDs, no spaces, each once)",
            )
        ]
    if gpus and visible.kind == "uuid":
        mapped = map_visible(visible, _physical(s), s.cuda_device_order)
        if len(mapped) < len(visible.ids):
            missing = visible.ids[len(mapped)]
            return [
                Finding(
                    "visible-devices",
                    f"CUDA_VISIBLE_DEVICES names {missing!r}, which matches no GPU (or "
                    f"several); the driver stops there and exposes {len(mapped)} GPU(s).",
                    "use the UUIDs `nvidia-smi -L` prints (or unique prefixes of them)",
                )
            ]
    return []


def _physical(s: EnvSnapshot) -> list[PhysicalGpu]:
    return physical_gpus(s.inventory.gpus)


def _visible_gpus(s: EnvSnapshot) -> list[nvml.NvmlGpu]:
    gpus = s.inventory.gpus
    if not gpus:
        return []
    visible = parse_visible_devices(s.cuda_visible_devices, device_count=len(gpus))
    by_index = {g.nvml_index: g for g in gpus}
    return [by_index[t.nvml_index] for t in map_visible(visible, _physical(s), s.cuda_device_order)]


def _build_findings(s: EnvSnapshot) -> list[Finding]:
    found: list[Finding] = []
    if s.torch_cuda is None and s.torch_hip is None and s.driver_evidence:
        found.append(
            Finding(
                "cpu-only-torch",
                f"an NVIDIA GPU and driver are present ({s.driver_evidence}) but torch "
                f"{s.torch_version} is a CPU-only build, so every run uses the CPU.",
                "install a CUDA build of torch, e.g. pip install torch --index-url "
                "https://download.pytorch.org/whl/cu126 (match the driver's CUDA version)",
            )
        )
    if s.torch_cuda is not None and s.nccl_available is False:
        found.append(
            Finding(
                "nccl-missing",
                f"torch {s.torch_version} is built for CUDA {s.torch_cuda} but without NCCL, "
                "so multi-GPU DDP/FSDP cannot use the GPU backend.",
                "install the official CUDA wheel of torch (it bundles NCCL) or use gloo",
            )
        )
    driver_cuda, torch_cuda = _version(s.inventory.cuda_driver_version), _version(s.torch_cuda)
    if driver_cuda and torch_cuda and driver_cuda[0] < torch_cuda[0] and s.torch_device_count == 0:
        found.append(
            Finding(
                "driver-too-old",
                f"the driver runs CUDA up to {s.inventory.cuda_driver_version} but torch is "
                f"built for CUDA {s.torch_cuda}, and torch sees no GPU.",
                "update the NVIDIA driver, or install a torch built for the driver's CUDA",
            )
        )
    return found


def _device_order_findings(s: EnvSnapshot) -> list[Finding]:
    readable = [g for g in s.inventory.gpus if g.error is None]
    kinds = {(g.name, g.total_bytes) for g in readable}
    order = (s.cuda_device_order or "FASTEST_FIRST").strip().upper()
    if len(kinds) > 1 and order != "PCI_BUS_ID":
        names = ", ".join(sorted(str(n) for n, _ in kinds))
        return [
            Finding(
                "device-order",
                f"the GPUs differ ({names}) and CUDA_DEVICE_ORDER is {order}, so torch's "
                "cuda:N and CUDA_VISIBLE_DEVICES ids may not match nvidia-smi's indices.",
                "export CUDA_DEVICE_ORDER=PCI_BUS_ID (before starting Python)",
            )
        ]
    return []


def _gpu_findings(s: EnvSnapshot, full_fraction: float) -> list[Finding]:
    found: list[Finding] = []
    for gpu in s.inventory.gpus:
        label = f"GPU {gpu.nvml_index} ({gpu.name or gpu.uuid or '?'})"
        if gpu.error:
            found.append(
                Finding(
                    "gpu-unreadable",
                    f"{label} cannot be read: {gpu.error}.",
                    "check `nvidia-smi` and the kernel log (Xid errors); reset the GPU "
                    "(nvidia-smi -r) or reboot, and avoid it with CUDA_VISIBLE_DEVICES meanwhile",
                )
            )
        if gpu.mig_enabled:
            example = next((m.uuid for m in gpu.mig_devices if m.uuid), "MIG-<uuid>")
            found.append(
                Finding(
                    "mig",
                    f"{label} is in MIG mode: CUDA sees MIG instances, not the whole GPU, and "
                    "a process uses one instance; ordinals in CUDA_VISIBLE_DEVICES do not "
                    "select instances.",
                    f"select an instance by UUID, e.g. CUDA_VISIBLE_DEVICES={example} "
                    "(`nvidia-smi -L` lists them), or disable MIG (nvidia-smi -mig 0)",
                )
            )
    for gpu in _visible_gpus(s):
        label = f"GPU {gpu.nvml_index} ({gpu.name or '?'})"
        used, total = gpu.used_bytes, gpu.total_bytes
        if total and used is not None and used >= full_fraction * total:
            found.append(
                Finding(
                    "gpu-full",
                    f"{label} is almost full: {format_bytes(used)} of {format_bytes(total)} used.",
                    "free it, or pick emptier GPUs: "
                    "CUDA_VISIBLE_DEVICES=$(torchgpu select -n 1 --min-free 8GiB)",
                )
            )
        others = [p for p in gpu.processes or () if p.pid not in s.own_pids]
        if others:
            who = ", ".join(
                f"pid {p.pid} {p.name or '?'} ({p.user or '?'}, {format_bytes(p.used_bytes)})"
                for p in others[:4]
            )
            found.append(
                Finding(
                    "gpu-busy",
                    f"{label} is used by {len(others)} other process(es): {who}.",
                    "they compete for memory and compute: wait, stop them, or pick free GPUs "
                    "with torchgpu select",
                )
            )
    return found


def find_problems(s: EnvSnapshot, full_fraction: float = FULL_FRACTION) -> list[Finding]:
    """Every pitfall in ``s``, in a stable order. Pure: no I/O."""
    return [
        *_visible_findings(s),
        *_device_order_findings(s),
        *_build_findings(s),
        *_gpu_findings(s, full_fraction),
    ]


def format_findings(findings: list[Finding], s: EnvSnapshot) -> str:
    """The text ``doctor`` prints."""
    if not findings:
        return (
            f"doctor: no problems found (torch {s.torch_version}, "
            f"{len(s.inventory.gpus)} GPU(s) seen by NVML)"
        )
    lines = [f"doctor: {len(findings)} problem(s) found"]
    for number, finding in enumerate(findings, start=1):
        lines.append(f"{number}. [{finding.code}] {finding.message}")
        lines.append(f"   fix: {finding.fix}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="torchgpu doctor",
        description="Find environment pitfalls; with --model, check a model's device placement.",
    )
    parser.add_argument("--model", metavar="MODULE:FACTORY", help="check this model's placement")
    parser.add_argument("--input-shape", metavar="N,C,...", help="input batch shape for --model")
    parser.add_argument("--devices", metavar="LIST", help="e.g. cuda:0,cuda:1 (for --model)")
    args = parser.parse_args(argv)
    if args.model is not None:
        return check_model_placement(args.model, args.input_shape, args.devices)
    if args.input_shape is not None or args.devices is not None:
        raise UsageError("--input-shape and --devices go with --model module:factory")
    snapshot = take_snapshot()
    findings = find_problems(snapshot)
    print(format_findings(findings, snapshot))
    return 1 if findings else 0
