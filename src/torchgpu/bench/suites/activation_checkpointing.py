"""``checkpointing``: activation memory vs step time for checkpoint segment counts.

ResNet-50 as 18 layers (stem, 16 blocks, head; a 16-layer MLP with ``--quick``) trained one
batch per sample; each variant
cuts it into k segments with :func:`torchgpu.apply_activation_checkpointing` (all but the
last segment recompute their activations in backward). Memory is the bytes autograd saves
for backward during one forward
(:func:`torchgpu.memory.saved_tensors.saved_tensor_bytes`, exact on any device) and, on
a GPU, the peak of ``torch.cuda.max_memory_allocated`` over one step.
The seed's claim: checkpointing trades time for memory ("slow, but useful").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import rounds_for, sync_for
from torchgpu.bench.suites.resnet_run import ResNetRun, peak_bytes, workload
from torchgpu.bench.timer import Measurement, Ratio, measure_interleaved, pairwise_ratios
from torchgpu.bench.verdict import find_ratio, time_verdict, value_verdict

FULL_RUN = ResNetRun(batch_size=32, image_px=128, num_batches=1, num_classes=1000)
QUICK_RUN = ResNetRun(batch_size=32, image_px=0, num_batches=1, num_classes=10)
NONE = "no checkpointing"
FULL_SEGMENTS: tuple[int | str, ...] = (2, 3, "sqrt", 9, 18)
QUICK_SEGMENTS: tuple[int | str, ...] = (2, "sqrt")


def segment_label(segments: int | str) -> str:
    return f"{segments} segments" if segments != "sqrt" else "sqrt segments"


def run(quick: bool, devices: Sequence[torch.device], out: Path, threads: int) -> SuiteResult:
    """One model; each variant re-applies checkpointing with its segment count, then steps."""
    from torchgpu.memory.activation_checkpointing import (
        apply_activation_checkpointing,
        remove_activation_checkpointing,
        sqrt_segments,
    )
    from torchgpu.memory.saved_tensors import saved_tensor_bytes

    cfg = QUICK_RUN if quick else FULL_RUN
    plan = rounds_for(quick)
    device = devices[0]
    work = workload(quick, cfg.batch_size, cfg.image_px, device)
    model, x, y = work.model, work.inputs, work.labels
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    loss_fn = nn.CrossEntropyLoss()

    def configure(segments: int | str | None) -> None:
        remove_activation_checkpointing(model)
        if segments is not None:
            apply_activation_checkpointing(model, segments=segments)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    def variant(segments: int | str | None) -> Callable[[], None]:
        def run_variant() -> None:
            configure(segments)
            step()

        return run_variant

    segment_options = QUICK_SEGMENTS if quick else FULL_SEGMENTS
    options: dict[str, int | str | None] = {NONE: None}
    options.update({segment_label(s): s for s in segment_options})
    timed = measure_interleaved({name: variant(s) for name, s in options.items()},
                                plan.rounds, plan.warmup, sync_for([device]))
    measurements: list[Measurement] = []
    for name, segments in options.items():
        configure(segments)
        saved = saved_tensor_bytes(lambda: loss_fn(model(x), y))
        optimizer.zero_grad(set_to_none=True)
        extra: dict[str, object] = {"saved_bytes": saved}
        if segments == "sqrt":
            extra["segments"] = sqrt_segments(len(model))
        elif segments is not None:
            extra["segments"] = segments
        peak = peak_bytes(device, step)
        if peak is not None:
            extra["peak_allocated_bytes"] = peak
        measurements.append(timed[name].with_extra(**extra))
    configure(None)
    by_name = {m.name: m for m in measurements}
    ratios = pairwise_ratios(by_name, [(name, NONE) for name in options if name != NONE])
    names = tuple(options)
    plots = [
        Plot(filename="time.png", kind="bar", title="training step time by checkpoint segments",
             ylabel="seconds per step, median [min..max]", names=names),
        Plot(filename="memory.png", kind="bar", title="activation bytes saved for backward",
             ylabel="MiB saved during the forward", names=names, value="extra:saved_bytes",
             best="min", scale=1 / 2**20),
    ]
    if device.type == "cuda":
        plots.append(Plot(filename="peak.png", kind="bar", title=f"peak memory on {device}",
                          ylabel="MiB (max_memory_allocated)", names=names,
                          value="extra:peak_allocated_bytes", best="min", scale=1 / 2**20))
    notes = [
        f"{work.name} on {device}, batch {cfg.batch_size}; k segments: all but the last "
        "recompute in backward.",
        "ratio 'k segments/no checkpointing' is the step-time cost of recomputation "
        "(> 1 = slower); saved_bytes is what autograd keeps for backward (less = better).",
    ]
    return SuiteResult(
        suite="checkpointing", quick=quick, devices=(str(device),),
        measurements=tuple(measurements), ratios=tuple(ratios), plots=tuple(plots),
        notes=tuple(notes),
        config={"model": work.name, "batch_size": cfg.batch_size, "layers": len(model),
                "segments": [str(s) for s in segment_options], "rounds": plan.rounds,
                "warmup": plan.warmup, "threads": threads},
        verdicts=tuple(memory_time_verdicts(measurements, ratios, NONE,
                                            "checkpointing trades time for memory")),
    )


def memory_time_verdicts(measurements: list[Measurement], ratios: list[Ratio], baseline: str,
                         claim: str) -> list[str]:
    """Per variant: its saved bytes (and GPU peak) relative to ``baseline``, and its time.

    The claim holds for a variant that keeps fewer bytes for backward than the baseline
    and costs more time (or the same): the trade the seed describes.
    """
    base = next(m for m in measurements if m.name == baseline)
    verdicts = []
    for m in measurements:
        if m.name == baseline:
            continue
        text = value_verdict(m.name, baseline, m.extra["saved_bytes"],
                             base.extra["saved_bytes"], "saved-activation bytes")
        if "peak_allocated_bytes" in m.extra and "peak_allocated_bytes" in base.extra:
            text += (f", {m.extra['peak_allocated_bytes'] / base.extra['peak_allocated_bytes']:.2f}"
                     "x the peak allocated")
        ratio = find_ratio(ratios, m.name, baseline)
        if ratio is not None:
            timing = time_verdict(m.name, baseline, ratio)
            text += ", " + timing.split(": ", 1)[1]
        less = m.extra["saved_bytes"] < base.extra["saved_bytes"]
        text += f" ({claim}: {'holds' if less else 'no memory saved here'})"
        verdicts.append(text)
    return verdicts
