"""``parallel``: seed 002's experiment — ResNet-50 on one device vs model parallel vs a
micro-batched pipeline, all timed in one interleaved run.

Devices: two GPUs if there are two; one GPU used twice; else the CPU twice (then model
parallel only adds hand-off cost and the pipeline cannot overlap anything — the rows are
kept so the code path and its overhead are measured). On CPU-only runs the multi-process
pipeline (``torchgpu.parallel.stages``, one process per stage) is interleaved with them
and compared with the single-device row, which is then the CPU single-process baseline
of the same run (see :mod:`torchgpu.bench.suites.stages_run`). Where the devices include
a GPU those CPU processes are not run: a GPU time divided by a CPU time says nothing, and
at the seed's size they would add many minutes (``--device cpu`` measures them).

Every ratio is ``variant time / single-device time`` per round: < 1 is faster.
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
    ResNetRun,
    base_model,
    make_batches,
    run_for,
    train_run,
)
from torchgpu.bench.timer import Measurement, Ratio, measure_interleaved, pairwise_ratios
from torchgpu.bench.verdict import find_ratio, time_verdict

SEED_SPLIT_SIZE = 20
QUICK_SPLIT_SIZE = 4
SINGLE, MODEL, PIPE = "single device", "model parallel", "pipeline"


def wants_stage_processes(pair: Sequence[torch.device]) -> bool:
    """Whether the CPU multi-process pipeline joins the run: only when every in-process
    variant runs on the CPU too, so its ratio to the single-device row is CPU vs CPU."""
    return all(d.type == "cpu" for d in pair)


def run(
    quick: bool,
    devices: Sequence[torch.device],
    out: Path,
    threads: int,
    size: str = "full",
) -> SuiteResult:
    """Time one training run (``num_batches`` batches) of each variant, interleaved."""
    from torchgpu.parallel.model import split_model
    from torchgpu.parallel.pipeline import Pipeline

    cfg = run_for(quick, size)
    plan = rounds_for(quick, size)
    pair, how = device_pair(devices)
    split = QUICK_SPLIT_SIZE if quick else SEED_SPLIT_SIZE
    chunks = cfg.chunks_for(split)
    pipe_name = f"{PIPE} (split {split})"
    with ExitStack() as stack:
        # Started first: the stage processes import torch while this process builds.
        stage_variants, stage_notes = _stage_variants(cfg, split, threads, stack, quick, pair)
        batches = make_batches(cfg)
        variants: dict[str, Callable[[], float | None]] = {
            SINGLE: train_run(base_model(cfg).to(pair[0]), batches),
            MODEL: train_run(split_model(base_model(cfg), pair), batches),
            # checkpoint="never": the seed's pipeline keeps every activation; recomputation
            # would be a different trade (see the checkpointing suite).
            pipe_name: train_run(
                Pipeline(base_model(cfg), pair, chunks=chunks, checkpoint="never"), batches
            ),
        }
        variants.update(stage_variants)
        timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for(pair),
                                    threads={name: threads for name in stage_variants})
    processes = {name: 2 for name in stage_variants}
    placed = {SINGLE: str(pair[0]), MODEL: f"{pair[0]},{pair[1]}",
              pipe_name: f"{pair[0]},{pair[1]}"}
    measurements = [
        m.with_extra(device=placed.get(n, "cpu x2 processes"), processes=processes.get(n, 1),
                     threads_total=processes.get(n, 1) * m.threads)
        for n, m in timed.items()
    ]
    by_name: dict[str, Measurement] = {m.name: m for m in measurements}
    pairs = [(MODEL, SINGLE), (pipe_name, SINGLE)] + [(name, SINGLE) for name in stage_variants]
    ratios = pairwise_ratios(by_name, pairs)
    notes = [
        f"devices: {pair[0]} + {pair[1]} ({how}); one run = {cfg.num_batches} batch(es) of "
        f"{cfg.batch_size} images {cfg.image_px}x{cfg.image_px} through {cfg.model_name}, SGD "
        f"+ MSE on one-hot labels, {plan.rounds} runs per variant after {plan.warmup} warm-up.",
        f"ratios are 'X/{SINGLE}' time ratios per round: < 1 means X is faster (seed: model "
        "parallel 1.07 = 7% slower; pipeline 0.67 = 1.49x faster at split 20).",
        f"thread budget: in-process variants 1 process x {threads} thread(s)"
        + (f"; '{next(iter(stage_variants))}' 2 processes x {threads} thread(s) = "
           f"{2 * threads} in all" if stage_variants else "") + ".",
    ]
    if pair[0] == pair[1]:
        notes.append(
            "both stages share one device, so nothing can overlap: this measures the cost of "
            "the split and the micro-batching, not a speed-up. Two GPUs are needed for that."
        )
    notes += stage_notes
    plot = Plot(
        filename="parallel.png", kind="bar",
        title=f"{cfg.model_name} training, {cfg.num_batches} batch(es) of {cfg.batch_size} "
              f"({how})",
        ylabel="execution time (s), median [min..max]", names=tuple(by_name),
    )
    return SuiteResult(
        suite="parallel", quick=quick, devices=tuple(str(d) for d in dict.fromkeys(pair)),
        measurements=tuple(measurements), ratios=tuple(ratios), plots=(plot,),
        notes=tuple(notes),
        config={"model": cfg.model_name, "batch_size": cfg.batch_size,
                "image_px": cfg.image_px, "num_batches": cfg.num_batches,
                "num_classes": cfg.num_classes, "split_size": split, "chunks": chunks,
                "rounds": plan.rounds, "warmup": plan.warmup, "placement": how,
                "threads": threads},
        verdicts=tuple(_verdicts(ratios, pipe_name, how, list(stage_variants))),
    )


def _verdicts(ratios: list[Ratio], pipe_name: str, how: str, stages: list[str]) -> list[str]:
    overlap = how == "two GPUs"
    verdicts = []
    model = find_ratio(ratios, MODEL, SINGLE)
    if model is not None:
        verdicts.append(time_verdict(MODEL, SINGLE, model, seed="1.07x slower",
                                     expect="slower"))
    pipe = find_ratio(ratios, pipe_name, SINGLE)
    if pipe is not None:
        text = time_verdict(pipe_name, SINGLE, pipe, seed="1.49x faster at split 20",
                            expect="faster" if overlap else None)
        if not overlap:
            text += f" ({how}: nothing can overlap, so the seed's speed-up cannot show here)"
        verdicts.append(text)
    for name in stages:
        stage = find_ratio(ratios, name, SINGLE)
        if stage is not None:
            verdicts.append(time_verdict(name, f"{SINGLE} (cpu, one process)", stage))
    return verdicts


def _stage_variants(cfg: ResNetRun, split: int, threads: int, stack: ExitStack, quick: bool,
                    pair: Sequence[torch.device]
                    ) -> tuple[dict[str, Callable[[], float]], list[str]]:
    """The multi-process CPU pipeline's variant, when it can run and be compared fairly."""
    import torch.distributed as dist

    if not wants_stage_processes(pair):
        return {}, ["multi-process CPU pipeline not run: the in-process variants are on a "
                    "GPU, and a GPU time over a CPU time compares nothing; measure it with "
                    "`torchgpu bench parallel --device cpu`."]
    if not dist.is_available():
        return {}, ["multi-process pipeline skipped: this torch build has no torch.distributed."]
    from torchgpu.bench.suites.stages_run import stage_variant

    return stage_variant(cfg, split, threads, stack, quick)
