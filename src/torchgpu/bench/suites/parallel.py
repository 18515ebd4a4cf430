"""``parallel``: seed 002's experiment — ResNet-50 on one device vs model parallel vs a
micro-batched pipeline, all timed in one interleaved run.

Devices: two GPUs if there are two; one GPU used twice; else the CPU twice (then model
parallel only adds hand-off cost and the pipeline cannot overlap anything — the rows are
kept so the code path and its overhead are measured). The multi-process pipeline on CPU
(``torchgpu.parallel.stages``, one process per stage) is interleaved with them
(see :mod:`torchgpu.bench.suites.stages_run`).

Seed's figures (2 GPUs): model parallel 4.02 s vs single 3.75 s (7% slower); pipeline with
split size 20: 2.51 s (1.49x faster than single); best split 12: 2.43 s (1.54x).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

import torch

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import device_pair, rounds_for, sync_for
from torchgpu.bench.suites.resnet_run import (
    QUICK_RUN,
    SEED_RUN,
    base_model,
    make_batches,
    train_run,
)
from torchgpu.bench.timer import Measurement, measure_interleaved, pairwise_ratios

SEED_SPLIT_SIZE = 20
QUICK_SPLIT_SIZE = 4
SINGLE, MODEL, PIPE = "single device", "model parallel", "pipeline"


def run(quick: bool, devices: Sequence[torch.device], out: Path) -> SuiteResult:
    """Time one training run (``num_batches`` batches) of each variant, interleaved."""
    from torchgpu.parallel.model import split_model
    from torchgpu.parallel.pipeline import Pipeline

    cfg = QUICK_RUN if quick else SEED_RUN
    plan = rounds_for(quick)
    pair, how = device_pair(devices)
    split = QUICK_SPLIT_SIZE if quick else SEED_SPLIT_SIZE
    chunks = cfg.chunks_for(split)
    batches = make_batches(cfg)
    pipe_name = f"{PIPE} (split {split})"
    variants: dict[str, Callable[[], float | None]] = {
        SINGLE: train_run(base_model(cfg).to(pair[0]), batches),
        MODEL: train_run(split_model(base_model(cfg), pair), batches),
        # checkpoint="never": the seed's pipeline keeps every activation; recomputation
        # would be a different trade (see the checkpointing suite).
        pipe_name: train_run(
            Pipeline(base_model(cfg), pair, chunks=chunks, checkpoint="never"), batches
        ),
    }
    with ExitStack() as stack:
        stage_variants, stage_notes = _stage_variants(quick, split, stack)
        variants.update(stage_variants)
        timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for(pair))
    notes = [
        f"devices: {pair[0]} + {pair[1]} ({how}); one run = {cfg.num_batches} batch(es) of "
        f"{cfg.batch_size} images {cfg.image_px}x{cfg.image_px}, SGD + MSE on one-hot labels, "
        f"{plan.rounds} runs per variant after {plan.warmup} warm-up.",
        f"ratio '{MODEL}/{SINGLE}' > 1 means model parallel is slower (seed: 4.02/3.75 = "
        f"1.07); '{SINGLE}/{pipe_name}' > 1 is the pipeline's speed-up (seed: 1.49 at split "
        "20, 1.54 at split 12).",
    ]
    if pair[0] == pair[1]:
        notes.append(
            "both stages share one device, so nothing can overlap: this measures the cost of "
            "the split and the micro-batching, not a speed-up. Two GPUs are needed for that."
        )
    placed = {SINGLE: str(pair[0]), MODEL: f"{pair[0]},{pair[1]}",
              pipe_name: f"{pair[0]},{pair[1]}"}
    measurements = [m.with_extra(device=placed.get(n, "cpu x2 processes"))
                    for n, m in timed.items()]
    by_name: dict[str, Measurement] = {m.name: m for m in measurements}
    pairs = [(MODEL, SINGLE), (SINGLE, pipe_name)]
    pairs += [(SINGLE, name) for name in stage_variants]
    ratios = pairwise_ratios(by_name, pairs)
    notes += stage_notes
    names = tuple(m.name for m in measurements)
    plot = Plot(
        filename="parallel.png", kind="bar",
        title=f"ResNet-50 training, {cfg.num_batches} batch(es) of {cfg.batch_size} ({how})",
        ylabel="execution time (s), median [min..max]", names=names,
    )
    return SuiteResult(
        suite="parallel", quick=quick, devices=tuple(str(d) for d in dict.fromkeys(pair)),
        measurements=tuple(measurements), ratios=tuple(ratios), plots=(plot,),
        notes=tuple(notes),
        config={"batch_size": cfg.batch_size, "image_px": cfg.image_px,
                "num_batches": cfg.num_batches, "num_classes": cfg.num_classes,
                "split_size": split, "chunks": chunks, "rounds": plan.rounds,
                "warmup": plan.warmup, "placement": how},
    )


def _stage_variants(quick: bool, split: int, stack: ExitStack
                    ) -> tuple[dict[str, Callable[[], float]], list[str]]:
    """The multi-process CPU pipeline's variant, when torch.distributed can run it."""
    import torch.distributed as dist

    if not dist.is_available():
        return {}, ["multi-process pipeline skipped: this torch build has no torch.distributed."]
    from torchgpu.bench.suites.stages_run import stage_variant

    return stage_variant(quick, split, stack)
