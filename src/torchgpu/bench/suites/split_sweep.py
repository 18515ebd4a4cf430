"""``split-sweep``: pipeline training time over split sizes — seed 002's last figure.

Split size = samples per micro-batch, so a batch of 120 at split 12 is ``ceil(120/12) = 10``
micro-batches (``Pipeline(chunks=10)``). Small splits launch many tiny kernels; large ones
leave a stage idle. The figure is the seed's: mean ± standard deviation per split size,
with the best (lowest mean) marked; the table keeps the median and [min..max] too.
Seed's result on two GPUs: best split 12, 2.43 s (1.54x faster than one GPU's 3.75 s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import device_pair, rounds_for, sync_for
from torchgpu.bench.suites.resnet_run import (
    QUICK_RUN,
    SEED_RUN,
    ResNetRun,
    base_model,
    make_batches,
    train_run,
)
from torchgpu.bench.timer import measure_interleaved

SEED_SPLIT_SIZES = (1, 3, 5, 8, 10, 12, 20, 40, 60)
QUICK_SPLIT_SIZES = (2, 4)


def split_label(split_size: int, run: ResNetRun) -> str:
    return f"split {split_size} ({run.chunks_for(split_size)} chunks)"


def _with_chunks(pipe: Any, chunks: int, step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        pipe.chunks = chunks
        step()

    return run


def run(quick: bool, devices: Sequence[torch.device], out: Path) -> SuiteResult:
    """Time one training run per split size, all split sizes interleaved per round."""
    from torchgpu.parallel.pipeline import Pipeline

    cfg = QUICK_RUN if quick else SEED_RUN
    plan = rounds_for(quick)
    pair, how = device_pair(devices)
    sizes = QUICK_SPLIT_SIZES if quick else SEED_SPLIT_SIZES
    batches = make_batches(cfg)
    # One pipeline, re-chunked per variant: every split size trains the same weights on the
    # same devices, and memory holds one model instead of one per split size.
    pipe = Pipeline(base_model(cfg), pair, chunks=1, checkpoint="never")
    step = train_run(pipe, batches)
    variants: dict[str, Callable[[], None]] = {
        split_label(size, cfg): _with_chunks(pipe, cfg.chunks_for(size), step) for size in sizes
    }
    timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for(pair))
    measurements = tuple(
        timed[split_label(s, cfg)].with_extra(split_size=s, chunks=cfg.chunks_for(s))
        for s in sizes
    )
    best = min(measurements, key=lambda m: m.mean)
    notes = [
        f"pipeline over {pair[0]} + {pair[1]} ({how}), batch {cfg.batch_size} at "
        f"{cfg.image_px}x{cfg.image_px}, {cfg.num_batches} batch(es) per run, "
        f"{plan.rounds} runs per split after {plan.warmup} warm-up; checkpoint='never'.",
        f"best split size here: {best.extra['split_size']} (mean {best.mean:.3f} s); "
        "the seed's best on two GPUs was 12.",
    ]
    if pair[0] == pair[1]:
        notes.append("both stages share one device: the sweep shows micro-batching overhead "
                     "only; the seed's trade-off needs two GPUs.")
    plot = Plot(
        filename="split_sweep.png", kind="line",
        title=f"Pipeline split size trade-off ({how})",
        ylabel="ResNet-50 execution time (s), mean ± std", xlabel="pipeline split size",
        names=tuple(m.name for m in measurements), x=tuple(float(s) for s in sizes),
        value="mean", best="min",
    )
    return SuiteResult(
        suite="split-sweep", quick=quick, devices=tuple(str(d) for d in dict.fromkeys(pair)),
        measurements=measurements, plots=(plot,), notes=tuple(notes),
        config={"batch_size": cfg.batch_size, "image_px": cfg.image_px,
                "num_batches": cfg.num_batches, "split_sizes": list(sizes),
                "rounds": plan.rounds, "warmup": plan.warmup, "placement": how,
                "best_split_size": best.extra["split_size"]},
    )
