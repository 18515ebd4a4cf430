"""``accumulation``: memory vs micro-batch size at a fixed effective batch (the seed's
"batch too big" remedy: accumulate gradients over k micro-batches before ``step``).

One ResNet-50 (a 16-layer MLP with ``--quick``) and one :class:`torchgpu.GradAccumulator`;
each variant sets k and trains one effective batch as k micro-batches of ``effective / k``
samples. Time is per effective batch (per optimizer step); memory is the bytes autograd
saves for one micro-batch's backward (the activation peak,
:func:`torchgpu.memory.saved_tensors.saved_tensor_bytes`) and, on a GPU,
``max_memory_allocated`` over one effective batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.activation_checkpointing import memory_time_verdicts
from torchgpu.bench.suites.common import rounds_for, sync_for
from torchgpu.bench.suites.resnet_run import ResNetRun, peak_bytes, workload
from torchgpu.bench.timer import Measurement, measure_interleaved, pairwise_ratios

FULL_RUN = ResNetRun(batch_size=64, image_px=64, num_batches=1, num_classes=1000)
QUICK_RUN = ResNetRun(batch_size=32, image_px=0, num_batches=1, num_classes=10)
FULL_MICRO = (64, 32, 16, 8)
QUICK_MICRO = (32, 8)


def micro_label(micro: int, effective: int) -> str:
    return f"micro-batch {micro} x {effective // micro}"


def run(quick: bool, devices: Sequence[torch.device], out: Path, threads: int) -> SuiteResult:
    """Interleave one optimizer step per micro-batch size; record memory per size."""
    from torchgpu.accumulate import GradAccumulator
    from torchgpu.memory.saved_tensors import saved_tensor_bytes

    cfg = QUICK_RUN if quick else FULL_RUN
    plan = rounds_for(quick)
    device = devices[0]
    effective = cfg.batch_size
    micros = QUICK_MICRO if quick else FULL_MICRO
    work = workload(quick, effective, cfg.image_px, device)
    model, x, y = work.model, work.inputs, work.labels
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    acc = GradAccumulator(model, optimizer, steps=1)
    loss_fn = nn.CrossEntropyLoss()
    missed: list[str] = []

    def variant(micro: int) -> Callable[[], None]:
        steps = effective // micro
        pieces = list(zip(torch.split(x, micro), torch.split(y, micro), strict=True))

        def one_effective_batch() -> None:
            acc.set_steps(steps)  # always called at a window boundary
            stepped = False
            for xb, yb in pieces:
                with acc.micro_step():
                    stepped = acc.backward(loss_fn(model(xb), yb))
            if not stepped:  # the window must close on its last micro-batch
                missed.append(micro_label(micro, effective))

        return one_effective_batch

    variants = {micro_label(m, effective): variant(m) for m in micros}
    timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for([device]))
    measurements: list[Measurement] = []
    for micro in micros:
        name = micro_label(micro, effective)
        xm, ym = x[:micro], y[:micro]
        saved = saved_tensor_bytes(lambda: loss_fn(model(xm), ym))  # noqa: B023
        extra: dict[str, object] = {"micro_batch": micro, "steps": effective // micro,
                                    "saved_bytes": saved}
        peak = peak_bytes(device, variants[name])
        if peak is not None:
            extra["peak_allocated_bytes"] = peak
        measurements.append(timed[name].with_extra(**extra))
    optimizer.zero_grad(set_to_none=True)
    full = micro_label(micros[0], effective)
    ratios = pairwise_ratios({m.name: m for m in measurements},
                             [(m.name, full) for m in measurements if m.name != full])
    notes = [
        f"{work.name} on {device}, effective batch {effective}; 'micro-batch m x k' = k "
        "micro-batches of m, one optimizer step.",
        f"ratio 'micro-batch m x k/{full}' is the time cost of smaller micro-batches (> 1 "
        "= slower); saved_bytes shrinks with the micro-batch.",
    ]
    if missed:
        notes.append(f"optimizer step missing at the window end for: {sorted(set(missed))}")
    names = tuple(variants)
    plots = [
        Plot(filename="memory.png", kind="bar", title="activation bytes per micro-batch",
             ylabel="MiB saved for backward", names=names, value="extra:saved_bytes",
             best="min", scale=1 / 2**20),
        Plot(filename="time.png", kind="bar", title=f"time per effective batch of {effective}",
             ylabel="seconds per optimizer step, median [min..max]", names=names),
    ]
    if device.type == "cuda":
        plots.append(Plot(filename="peak.png", kind="bar", title=f"peak memory on {device}",
                          ylabel="MiB (max_memory_allocated)", names=names,
                          value="extra:peak_allocated_bytes", best="min", scale=1 / 2**20))
    return SuiteResult(
        suite="accumulation", quick=quick, devices=(str(device),),
        measurements=tuple(measurements), ratios=tuple(ratios), plots=tuple(plots),
        notes=tuple(notes),
        config={"model": work.name, "effective_batch": effective,
                "micro_batches": list(micros), "rounds": plan.rounds, "warmup": plan.warmup,
                "threads": threads},
        verdicts=tuple(memory_time_verdicts(measurements, ratios, full,
                                            "accumulation fits big batches in less memory")),
    )
