"""``matmul``: CPU vs GPU TFLOP/s over square matrix sizes (the seeds' "why use a GPU").

At each size the CPU and every GPU are measured in one interleaved run. Small sizes repeat
the product inside one sample so a sample is long enough to time, and the repeat count
differs by device (a GPU needs far more work per sample than a CPU). So the GPU's
speed-up is a ratio of *rates*, per round: GPU TFLOP/s / CPU TFLOP/s (each sample's FLOPs
include its repeats) -- never a ratio of the two samples' seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from torchgpu.bench.result import Plot, Series, SuiteResult
from torchgpu.bench.suites.common import gpus, rounds_for, seed_all, sync_for
from torchgpu.bench.timer import Measurement, Ratio, measure_interleaved, rate_ratios
from torchgpu.bench.verdict import rate_verdict

CPU_SIZES_FULL = (256, 512, 1024, 2048)
GPU_SIZES_FULL = (256, 512, 1024, 2048, 4096, 8192)
CPU_SIZES_QUICK = (64, 256)
GPU_SIZES_QUICK = (256, 1024)  # 256 is shared with the CPU, so a quick GPU run has a ratio
# Work per sample (multiply-adds) below which the product is repeated inside the sample.
CPU_MIN_WORK = 2**27
GPU_MIN_WORK = 2**33


def repeats(n: int, device: torch.device) -> int:
    """How many n x n products one sample holds so it is long enough to time."""
    floor = GPU_MIN_WORK if device.type == "cuda" else CPU_MIN_WORK
    return max(1, floor // n**3)


def flops_per_sample(n: int, reps: int) -> float:
    """FLOPs of one sample: ``reps`` products of two n x n matrices, 2 n^3 each."""
    return 2.0 * n**3 * reps


def speedups(timed: Mapping[str, Measurement], flops: Mapping[str, float],
             cpu_name: str) -> list[Ratio]:
    """Per round, each other variant's TFLOP/s over ``cpu_name``'s: the GPU's speed-up.

    ``timed`` holds seconds per sample from one interleaved run and ``flops`` each
    variant's FLOPs per sample, so variants that repeat the product a different number of
    times per sample are compared per product.
    """
    if cpu_name not in timed:
        return []
    pairs = [(name, cpu_name) for name in timed if name != cpu_name]
    return rate_ratios(timed, flops, pairs)


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _label(device: torch.device, n: int, dtype: torch.dtype) -> str:
    return f"{device} n={n} {_dtype_name(dtype)}"


def run(quick: bool, devices: Sequence[torch.device], out: Path, threads: int) -> SuiteResult:
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
        "TFLOP/s = 2*n^3 per product x products per sample / time. GPU fp32 products use "
        "TF32 only if enabled (torch.backends.cuda.matmul.allow_tf32="
        f"{torch.backends.cuda.matmul.allow_tf32}).",
        f"CPU rows use {threads} thread(s) (--threads); a multi-core CPU does more with "
        "--threads set to its core count.",
    ]
    if not cuda:
        notes.append("no GPU among the devices: CPU rows only; GPU rows need a CUDA machine.")
    for n in sorted(set(cpu_sizes) | (set(gpu_sizes) if cuda else set())):
        for dtype in dtypes:
            targets = ([cpu] if n in cpu_sizes and dtype == torch.float32 else [])
            targets += [g for g in cuda if n in gpu_sizes]
            if not targets:
                continue
            variants, flops = {}, {}
            reps: dict[str, int] = {}
            for device in targets:
                name = _label(device, n, dtype)
                variants[name], reps[name] = _product(n, device, dtype)
                flops[name] = flops_per_sample(n, reps[name])
            timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for(targets))
            ratios += speedups(timed, flops, _label(cpu, n, dtype))
            for name, m in timed.items():
                measurements.append(
                    m.derive(_tflops(flops[name]), unit="TFLOP/s").with_extra(
                        device=name.split(" ")[0], n=n, dtype=_dtype_name(dtype),
                        repeats=reps[name],
                    )
                )
    if ratios:
        notes.append("ratio 'cuda:N .../cpu ...' = GPU TFLOP/s / CPU TFLOP/s per round, at "
                     "the same size: the GPU's speed-up per product.")
    return SuiteResult(
        suite="matmul", quick=quick, devices=tuple(str(d) for d in [cpu, *cuda]),
        measurements=tuple(measurements), ratios=tuple(ratios),
        plots=(_plot(measurements, [cpu, *cuda], dtypes),), notes=tuple(notes),
        config={"cpu_sizes": list(cpu_sizes), "gpu_sizes": list(gpu_sizes) if cuda else [],
                "rounds": plan.rounds, "warmup": plan.warmup, "threads": threads},
        verdicts=tuple(_verdicts(ratios, bool(cuda), threads)),
    )


def _plot(measurements: list[Measurement], devices: list[torch.device],
          dtypes: list[torch.dtype]) -> Plot:
    """One log-log chart, a line per device and dtype: CPU and GPU on the same axes."""
    series = []
    for device in devices:
        for dtype in dtypes:
            rows = [m for m in measurements if m.extra["device"] == str(device)
                    and m.extra["dtype"] == _dtype_name(dtype)]
            if rows:
                series.append(Series(f"{device} {_dtype_name(dtype)}",
                                     tuple(m.name for m in rows),
                                     tuple(float(m.extra["n"]) for m in rows)))
    return Plot(filename="tflops.png", kind="line", title="torch.mm throughput, CPU vs GPU",
                ylabel="TFLOP/s (median, [min..max])", xlabel="matrix size n (n x n)",
                names=(), series=tuple(series), xscale="log2", yscale="log")


def _verdicts(ratios: list[Ratio], has_gpu: bool, threads: int) -> list[str]:
    if not has_gpu:
        return ["GPUs are faster at matrix work: not checked here (no GPU among the devices)."]
    verdicts = []
    by_gpu: dict[str, Ratio] = {}
    for ratio in ratios:  # sizes ascend: keep the largest size measured on both
        by_gpu[ratio.numerator.split(" n=")[0] + " " + ratio.numerator.split()[-1]] = ratio
    for ratio in by_gpu.values():
        verdicts.append(rate_verdict(ratio.numerator, f"{ratio.denominator} ({threads} "
                                     "thread(s))", ratio, "TFLOP/s", expect="higher"))
    return verdicts
