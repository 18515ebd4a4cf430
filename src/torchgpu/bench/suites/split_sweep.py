"""``split-sweep``: pipeline training time over split sizes — seed 002's last figure.

Split size = samples per micro-batch, so a batch of 120 at split 12 is ``ceil(120/12) = 10``
micro-batches (``Pipeline(chunks=10)``). Small splits launch many tiny kernels; large ones
leave a stage idle. The figure is the seed's: mean ± standard deviation per split size,
with the best (lowest mean) marked and the single-device time as a reference line; the
single device runs in the same interleaved rounds, so each split has a per-round ratio
``split k / single device`` (< 1: the pipeline is faster). The table keeps the median and
[min..max] too. Seed's result on two GPUs: best split 12, 2.43 s (1.54x faster than one
GPU's 3.75 s).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import device_pair, rounds_for, sync_for
from torchgpu.bench.suites.resnet_run import (
    ResNetRun,
    base_model,
    make_batches,
    run_for,
    train_run,
)
from torchgpu.bench.timer import Measurement, measure_interleaved, pairwise_ratios
from torchgpu.bench.verdict import find_ratio, time_verdict

SEED_SPLIT_SIZES = (1, 3, 5, 8, 10, 12, 20, 40, 60)
QUICK_SPLIT_SIZES = (2, 4)
SINGLE = "single device"


def split_label(split_size: int, run: ResNetRun) -> str:
    return f"split {split_size} ({run.chunks_for(split_size)} chunks)"


class _Chunked(Protocol):
    chunks: int


def _with_chunks(pipe: _Chunked, chunks: int, step: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        pipe.chunks = chunks
        step()

    return run


def best_split(measurements: Sequence[Measurement]) -> Measurement:
    """The split with the lowest mean time (the seed's figure marks the mean)."""
    return min(measurements, key=lambda m: m.mean)


def run(
    quick: bool,
    devices: Sequence[torch.device],
    out: Path,
    threads: int,
    size: str = "full",
) -> SuiteResult:
    """Time one training run per split size and on a single device, interleaved per round."""
    from torchgpu.parallel.pipeline import Pipeline

    cfg = run_for(quick, size)
    plan = rounds_for(quick, size)
    pair, how = device_pair(devices)
    sizes = QUICK_SPLIT_SIZES if quick else SEED_SPLIT_SIZES
    batches = make_batches(cfg)
    # One pipeline, re-chunked per variant: every split size trains the same weights on the
    # same devices, and memory holds one model instead of one per split size.
    pipe = Pipeline(base_model(cfg), pair, chunks=1, checkpoint="never")
    step = train_run(pipe, batches)
    variants: dict[str, Callable[[], None]] = {
        SINGLE: train_run(base_model(cfg).to(pair[0]), batches),
    }
    variants.update({split_label(size, cfg): _with_chunks(pipe, cfg.chunks_for(size), step)
                     for size in sizes})
    timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for(pair))
    splits = [timed[split_label(s, cfg)].with_extra(split_size=s, chunks=cfg.chunks_for(s))
              for s in sizes]
    best = best_split(splits)
    splits = [m.with_extra(best=True) if m is best else m for m in splits]
    single = timed[SINGLE].with_extra(device=str(pair[0]))
    measurements = (single, *splits)
    ratios = pairwise_ratios({m.name: m for m in measurements},
                             [(m.name, SINGLE) for m in splits])
    best_ratio = find_ratio(ratios, best.name, SINGLE)
    notes = [
        f"pipeline over {pair[0]} + {pair[1]} ({how}), {cfg.model_name}, batch "
        f"{cfg.batch_size} at {cfg.image_px}x{cfg.image_px}, {cfg.num_batches} batch(es) per "
        f"run, {plan.rounds} runs per variant after {plan.warmup} warm-up; "
        f"checkpoint='never'; '{SINGLE}' is the whole model on {pair[0]} in the same rounds.",
        f"ratios 'split k/{SINGLE}' are time ratios per round: < 1 means the pipeline at "
        "that split is faster than one device (seed's best: 2.43/3.75 = 0.65 at split 12).",
        f"best split size here: {best.extra['split_size']} (mean {best.mean:.3f} s); the "
        "seed's best on two GPUs was 12.",
    ]
    if pair[0] == pair[1]:
        notes.append("both stages share one device: the sweep shows micro-batching overhead "
                     "only; the seed's trade-off needs two GPUs.")
    plot = Plot(
        filename="split_sweep.png", kind="line",
        title=f"Pipeline split size trade-off, {cfg.model_name} ({how})",
        ylabel="execution time per run (s), mean ± std", xlabel="pipeline split size",
        names=tuple(m.name for m in splits), x=tuple(float(s) for s in sizes),
        value="mean", best="min", xscale="log", reference=SINGLE,
    )
    verdicts = []
    if best_ratio is not None:
        verdicts.append(
            time_verdict(f"best split ({best.extra['split_size']})", SINGLE, best_ratio,
                         seed="best split 12, 1.54x faster",
                         expect="faster" if how == "two GPUs" else None)
            + ("" if how == "two GPUs" else f" ({how}: nothing can overlap)")
        )
    return SuiteResult(
        suite="split-sweep", quick=quick, devices=tuple(str(d) for d in dict.fromkeys(pair)),
        measurements=measurements, ratios=tuple(ratios), plots=(plot,), notes=tuple(notes),
        config={"model": cfg.model_name, "batch_size": cfg.batch_size,
                "image_px": cfg.image_px, "num_batches": cfg.num_batches,
                "split_sizes": list(sizes), "rounds": plan.rounds, "warmup": plan.warmup,
                "placement": how, "best_split_size": best.extra["split_size"],
                "threads": threads},
        verdicts=tuple(verdicts),
    )
