"""Loop overhead: torchgpu's training loop vs a hand-written raw loop.

The seed's housing MLP (13-16-32-1), batch 128, Adam, one thread, the same DataLoader
recipe for every variant. Variants are timed in >= 7 interleaved rounds (each round runs
every variant once, in a seeded random order); a sample is E epochs. Reported: steps/s
per variant (median) and the per-round ratio torchgpu/raw (median). Lightning Fabric
and Accelerate join when importable (the dev extra), so the comparison is one run.

    python benchmarks/overhead.py                 # full size
    python benchmarks/overhead.py --quick         # tiny, checks it runs
    python benchmarks/overhead.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from torchgpu.accumulate import GradAccumulator
from torchgpu.bench.timer import measure_interleaved
from torchgpu.data import example_data, make_loader
from torchgpu.models import HousingNet
from torchgpu.precision import Precision
from torchgpu.train.backoff import LoopBackoff
from torchgpu.train.loop import LoopParts, run_epoch, start_epoch
from torchgpu.train.runner import Shard
from torchgpu.train.state import StopFlag, TrainState


def _setup(batch: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = HousingNet()
    data = example_data("housing", seed=0)
    loader = make_loader(data.train, batch, shuffle=True, seed=0, dist=Shard(0, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), loader


def raw_variant(batch: int, epochs: int) -> Callable[[], None]:
    model, optimizer, loader = _setup(batch)
    loss_fn = nn.MSELoss()

    def run() -> None:
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()

    return run


def torchgpu_variant(batch: int, epochs: int) -> Callable[[], None]:
    model, optimizer, loader = _setup(batch)
    precision = Precision("fp32", "cpu")
    acc = GradAccumulator(model, optimizer, 1, precision=precision)
    # As `torchgpu train` runs it: OOM back-off armed, a stop flag, the loss read per step.
    backoff = LoopBackoff(model, acc, nn.MSELoss(), batch_size=batch)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc, precision=precision,
                      device=torch.device("cpu"), backoff=backoff)
    stop = StopFlag()
    per_epoch = len(loader)

    def run() -> None:
        state = TrainState()
        records: list[tuple[int, int, float]] = []
        for epoch in range(epochs):
            state.begin_epoch(epoch)
            run_epoch(parts, start_epoch(loader, 0, epoch), state,
                      batches_per_epoch=per_epoch, records=records, stop=stop)

    return run


def fabric_variant(batch: int, epochs: int) -> Callable[[], None] | None:
    try:
        from lightning.fabric import Fabric
    except ImportError:
        return None
    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer, loader = _setup(batch)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    loss_fn = nn.MSELoss()

    def run() -> None:
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                fabric.backward(loss_fn(model(x), y))
                optimizer.step()

    return run


def accelerate_variant(batch: int, epochs: int) -> Callable[[], None] | None:
    try:
        from accelerate import Accelerator
    except ImportError:
        return None
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(*_setup(batch))
    loss_fn = nn.MSELoss()

    def run() -> None:
        for _ in range(epochs):
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                accelerator.backward(loss_fn(model(x), y))
                optimizer.step()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=60, help="epochs per sample")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    rounds, epochs = (3, 3) if args.quick else (max(args.rounds, 7), args.epochs)
    torch.set_num_threads(1)
    builders = {"raw": raw_variant, "torchgpu": torchgpu_variant,
                "fabric": fabric_variant, "accelerate": accelerate_variant}
    variants = {name: fn for name, build in builders.items()
                if (fn := build(args.batch_size, epochs)) is not None}
    results = measure_interleaved(variants, rounds=rounds, warmup=1)
    steps = epochs * -(-404 // args.batch_size)
    report: dict[str, Any] = {"batch_size": args.batch_size, "epochs_per_sample": epochs,
                              "steps_per_sample": steps, "rounds": rounds, "threads": 1,
                              "torch": torch.__version__, "variants": {}}
    raw = results["raw"].samples
    for name, m in results.items():
        ratios = [r / s for r, s in zip(raw, m.samples, strict=True)]  # speed vs raw
        report["variants"][name] = {
            "steps_per_s_median": steps / m.median,
            "steps_per_s_min": steps / m.max,
            "steps_per_s_max": steps / m.min,
            "ratio_vs_raw_median": statistics.median(ratios),
        }
        print(f"{name:10s} {steps / m.median:9.1f} steps/s  "
              f"[{steps / m.max:.1f} .. {steps / m.min:.1f}]  "
              f"x{statistics.median(ratios):.3f} of raw")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
