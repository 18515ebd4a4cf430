"""ResNet-50 training steps on one device: bf16 vs fp32, and torchgpu's loop vs a raw loop.

Six variants, each its own identically seeded ResNet-50 with Adam and cross-entropy,
interleaved per round over the same pinned host batches:

- ``raw loop fp32`` / ``raw loop bf16``: the hand-written loop (copy, zero_grad, forward
  under autocast for bf16, loss, ``loss.item()``, backward, step);
- ``torchgpu loop fp32`` / ``torchgpu loop bf16``: what ``torchgpu train`` runs per step
  (:class:`torchgpu.bench.suites.train_step.TrainEpoch`: Prefetcher, GradAccumulator,
  Precision, OOM back-off armed, step records);
- two more in bf16 with the model in channels-last memory format
(``model.to(memory_format=torch.channels_last)``, the layout cuDNN's tensor-core
convolutions prefer): the raw loop converting each batch too, and torchgpu's loop given
that model and nothing else (does the engine need to convert the batches?).

Ratios per round: ``raw loop fp32 / raw loop bf16`` (time; > 1 = bf16 is that many times
faster; goal >= 2x), ``raw loop bf16 / raw loop bf16 channels_last`` (what the layout
buys) and ``torchgpu loop X / raw loop X`` (the loop's overhead; goal <= 1.02x).
fp32 convolutions use TF32 where cuDNN allows it (torch's default), as a user's fp32 run
does. Written like a bench suite: ``--out DIR`` gets results.json, report.md and
a plot (benchmarks/summarize.py renders it).

    PYTHONPATH=src python3 benchmarks/gpu/resnet_step.py --device cuda:0 --out DIR
    PYTHONPATH=src python3 benchmarks/gpu/resnet_step.py --device cpu --quick --out DIR
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent / "src"))

from torchgpu.bench.pressure import PressureMonitor
from torchgpu.bench.report import write_report
from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import sync_for
from torchgpu.bench.timer import measure_interleaved, pairwise_ratios
from torchgpu.bench.verdict import time_verdict

LR = 1e-3
PRECISIONS = ("fp32", "bf16")
CL = "bf16 channels_last"  # the variants' suffix for bf16 with a channels-last model
BF16_GOAL = 2.0
OVERHEAD_GOAL = 1.02
Batches = list[tuple[Tensor, Tensor]]


def make_model(quick: bool, classes: int) -> nn.Module:
    """ResNet-50 (quick: one bottleneck block per stage), seeded: every variant equal."""
    from torchgpu.models.resnet import ResNet

    torch.manual_seed(0)
    return ResNet((1, 1, 1, 1) if quick else (3, 4, 6, 3), num_classes=classes)


def make_batches(count: int, batch: int, px: int, classes: int, device: torch.device
                 ) -> Batches:
    """``count`` (images, labels) batches on the host, pinned when the device is CUDA."""
    gen = torch.Generator().manual_seed(1)
    made = [(torch.randn(batch, 3, px, px, generator=gen),
             torch.randint(0, classes, (batch,), generator=gen)) for _ in range(count)]
    if device.type == "cuda":
        made = [(x.pin_memory(), y.pin_memory()) for x, y in made]
    return made


def raw_loop(model: nn.Module, batches: Batches, device: torch.device, precision: str,
             channels_last: bool = False) -> Callable[[], None]:
    """One epoch the way a tutorial writes it, with autocast for bf16 (``channels_last``:
    the model and each batch in channels-last memory format, as torch's guide does)."""
    layout = torch.channels_last if channels_last else torch.preserve_format
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    dtype = torch.bfloat16 if precision == "bf16" else None

    def epoch() -> None:
        model.train()
        for xb, yb in batches:
            x = xb.to(device, non_blocking=True).contiguous(memory_format=layout)
            y = yb.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model(x), y)
            loss.item()
            loss.backward()
            optimizer.step()

    return epoch


def torchgpu_loop(model: nn.Module, batches: Batches, device: torch.device, precision: str
                  ) -> Callable[[], None]:
    """One epoch through torchgpu's training loop, built as ``torchgpu train`` builds it."""
    from torchgpu.bench.suites.train_step import TrainEpoch, loop_parts

    batch = int(batches[0][0].shape[0])
    epoch = TrainEpoch(model, device, batches, batch_size=batch, lr=LR)
    epoch.parts = loop_parts(model, device, batch_size=batch, lr=LR,
                             loss_fn=nn.CrossEntropyLoss(),
                             precision=precision, state=epoch.state,
                             samples=batch * len(batches))
    return epoch


def run(device: torch.device, quick: bool, batch: int, px: int, count: int, rounds: int,
        warmup: int) -> SuiteResult:
    classes = 10 if quick else 1000
    batches = make_batches(count, batch, px, classes, device)
    variants: dict[str, Callable[[], None]] = {}
    for precision in PRECISIONS:
        variants[f"raw loop {precision}"] = raw_loop(
            make_model(quick, classes).to(device), batches, device, precision)
        variants[f"torchgpu loop {precision}"] = torchgpu_loop(
            make_model(quick, classes).to(device), batches, device, precision)
    variants[f"raw loop {CL}"] = raw_loop(make_model(quick, classes).to(device), batches,
                                          device, "bf16", channels_last=True)
    variants[f"torchgpu loop {CL}"] = torchgpu_loop(
        make_model(quick, classes).to(device, memory_format=torch.channels_last), batches,
        device, "bf16")
    timed = measure_interleaved(variants, rounds, warmup, sync_for([device]))
    measurements = tuple(m.with_extra(step_ms=m.median / count * 1e3, batch=batch,
                                      image_px=px) for m in timed.values())
    pairs = [("raw loop fp32", "raw loop bf16"), ("raw loop bf16", f"raw loop {CL}")] + [
        (f"torchgpu loop {p}", f"raw loop {p}") for p in (*PRECISIONS, CL)]
    ratios = pairwise_ratios(timed, pairs)
    speed, layout, *loops = ratios
    verdicts = [f"bf16 vs fp32 training step (raw loops): bf16 is {speed.median:.2f}x as fast "
                f"[{speed.min:.2f}x .. {speed.max:.2f}x] (goal >= {BF16_GOAL:g}x: "
                + ("met" if speed.median >= BF16_GOAL else "missed") + ")",
                f"channels-last vs the default layout, bf16 (raw loops): channels-last is "
                f"{layout.median:.2f}x as fast [{layout.min:.2f}x .. {layout.max:.2f}x]"]
    for ratio in loops:
        verdicts.append(time_verdict(ratio.numerator, ratio.denominator, ratio,
                                     seed=f"design target: within {OVERHEAD_GOAL}x")
                        + (": target met" if ratio.median <= OVERHEAD_GOAL
                           else ": target missed here"))
    model_name = "ResNet (1-1-1-1 blocks)" if quick else "ResNet-50"
    notes = (f"{model_name}, batch {batch} of {px}x{px} images, {classes} classes, Adam; one "
             f"sample = {count} steps on {device}; {rounds} rounds after {warmup} warm-up.",
             "ratio 'raw loop fp32/raw loop bf16' = fp32 time / bf16 time: bf16's speed-up; "
             f"'raw loop bf16/raw loop {CL}': the channels-last layout's. "
             "'torchgpu loop X/raw loop X' > 1 is the loop's overhead.",
             f"'{CL}': the model converted with model.to(memory_format=torch.channels_last); "
             "the raw loop converts each batch as well, torchgpu's loop is given the "
             "converted model only (its first convolution converts the batch).",
             f"TF32: cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}, "
             f"matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}.")
    plot = Plot(filename="resnet50-step.png", kind="bar",
                title=f"{model_name} training, {count} steps of batch {batch}",
                ylabel="seconds, median [min..max]", names=tuple(timed))
    return SuiteResult(
        suite="resnet50-step", quick=quick, devices=(str(device),),
        measurements=measurements, ratios=tuple(ratios), plots=(plot,), notes=notes,
        config={"batch_size": batch, "image_px": px, "steps_per_sample": count,
                "rounds": rounds, "warmup": warmup, "classes": classes,
                "model": model_name, "optimizer": "Adam"},
        verdicts=tuple(verdicts))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="cuda:N or cpu (default cuda:0)")
    p.add_argument("--out", type=Path, required=True, help="directory for results.json")
    p.add_argument("--quick", action="store_true",
                   help="a 1-1-1-1 block ResNet at 32x32, 2 rounds: checks that it runs")
    p.add_argument("--batch-size", type=int, default=None, help="default 128 (quick 4)")
    p.add_argument("--image-px", type=int, default=None, help="default 224 (quick 32)")
    p.add_argument("--steps", type=int, default=None, help="steps per sample (default 5)")
    p.add_argument("--rounds", type=int, default=None, help="default 7 (quick 2)")
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: no CUDA GPU is visible; use --device cpu --quick")
    quick = args.quick
    batch = args.batch_size or (4 if quick else 128)
    px = args.image_px or (32 if quick else 224)
    steps = args.steps or (2 if quick else 5)
    rounds = args.rounds or (2 if quick else 7)
    monitor = PressureMonitor()
    monitor.start()
    started = time.perf_counter()
    result = run(device, quick, batch, px, steps, rounds, args.warmup)
    doc = write_report(result, args.out, monitor.stop(), time.perf_counter() - started,
                       argv=["benchmarks/gpu/resnet_step.py", *(argv or sys.argv[1:])])
    for verdict in doc["verdicts"]:
        print(verdict)
    print(f"results: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
