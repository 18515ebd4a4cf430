"""``matmul``: CPU vs GPU TFLOP/s over square matrix sizes (the seeds' "why use a GPU").

At each size the CPU and every GPU are measured in one interleaved run, so the per-round
ratio ``cpu/cuda:N`` is the GPU's speed-up at that size. Small sizes repeat the product
inside one sample so a sample is long enough to time (the FLOP count includes the repeats).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import gpus, rounds_for, seed_all, sync_for
from torchgpu.bench.timer import Measurement, Ratio, measure_interleaved, pairwise_ratios

CPU_SIZES_FULL = (256, 512, 1024, 2048)
GPU_SIZES_FULL = (256, 512, 1024, 2048, 4096, 8192)
CPU_SIZES_QUICK = (64, 128)
GPU_SIZES_QUICK = (256, 1024)
# Work per sample (multiply-adds) below which the product is repeated inside the sample.
CPU_MIN_WORK = 2**27
GPU_MIN_WORK = 2**33


def repeats(n: int, device: torch.device) -> int:
    """How many n x n products one sample holds so it is long enough to time."""
    floor = GPU_MIN_WORK if device.type == "cuda" else CPU_MIN_WORK
    return max(1, floor // n**3)


def _product(n: int, device: torch.device, dtype: torch.dtype) -> tuple[Callable[[], None], int]:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    reps = repeats(n, device)

    def step() -> None:
        for _ in range(reps):
            torch.mm(a, b, out=c)

    return step, reps


def _tflops(flops: float) -> Callable[[float], float]:
    def rate(seconds: float) -> float:
        return flops / seconds / 1e12

    return rate


def _label(device: torch.device, n: int, dtype: torch.dtype) -> str:
    return f"{device} n={n} {str(dtype).removeprefix('torch.')}"


def run(quick: bool, devices: Sequence[torch.device], out: Path) -> SuiteResult:
    """Measure TFLOP/s of ``torch.mm`` on the CPU and each GPU in ``devices``."""
    seed_all()
    plan = rounds_for(quick)
    cuda = gpus(devices)
    cpu = torch.device("cpu")
    cpu_sizes = CPU_SIZES_QUICK if quick else CPU_SIZES_FULL
    gpu_sizes = GPU_SIZES_QUICK if quick else GPU_SIZES_FULL
    dtypes = [torch.float32] + ([] if quick or not cuda else [torch.bfloat16])
    measurements: list[Measurement] = []
    ratios: list[Ratio] = []
    notes = [
        "TFLOP/s = 2*n^3 per product / time. GPU fp32 products use TF32 only if enabled "
        f"(torch.backends.cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}).",
    ]
    if not cuda:
        notes.append("no GPU among the devices: CPU rows only; GPU rows need a CUDA machine.")
    for n in sorted(set(cpu_sizes) | (set(gpu_sizes) if cuda else set())):
        for dtype in dtypes:
            targets = ([cpu] if n in cpu_sizes and dtype == torch.float32 else [])
            targets += [g for g in cuda if n in gpu_sizes]
            if not targets:
                continue
            variants, reps = {}, {}
            for device in targets:
                name = _label(device, n, dtype)
                variants[name], reps[name] = _product(n, device, dtype)
            timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for(targets))
            cpu_name = _label(cpu, n, dtype)
            if cpu_name in timed:
                pairs = [(cpu_name, name) for name in timed if name != cpu_name]
                ratios += pairwise_ratios(timed, pairs)
            for name, m in timed.items():
                flops = 2.0 * n**3 * reps[name]
                measurements.append(
                    m.derive(_tflops(flops), unit="TFLOP/s").with_extra(
                        device=name.split(" ")[0], n=n, dtype=str(dtype).removeprefix("torch."),
                        repeats=reps[name],
                    )
                )
    if ratios:
        notes.append("ratio cpu/cuda:N = CPU time / GPU time per round = the GPU's speed-up.")
    plots = []
    for device in [cpu, *cuda]:
        for dtype in dtypes:
            names = tuple(m.name for m in measurements
                          if m.extra["device"] == str(device)
                          and m.extra["dtype"] == str(dtype).removeprefix("torch."))
            if not names:
                continue
            tag = f"{str(device).replace(':', '')}-{str(dtype).removeprefix('torch.')}"
            plots.append(Plot(
                filename=f"tflops-{tag}.png", kind="line",
                title=f"matmul on {device} ({str(dtype).removeprefix('torch.')})",
                ylabel="TFLOP/s (median, [min..max])", xlabel="matrix size n",
                names=names, x=tuple(float(n.split("n=")[1].split()[0]) for n in names),
                best="max",
            ))
    return SuiteResult(
        suite="matmul", quick=quick, devices=tuple(str(d) for d in [cpu, *cuda]),
        measurements=tuple(measurements), ratios=tuple(ratios), plots=tuple(plots),
        notes=tuple(notes),
        config={"cpu_sizes": list(cpu_sizes), "gpu_sizes": list(gpu_sizes) if cuda else [],
                "rounds": plan.rounds, "warmup": plan.warmup},
    )
