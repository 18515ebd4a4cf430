"""``overhead``: what a training loop costs beyond the model's own work.

For a tiny MLP (the seed's housing net, 13-16-32-1, where per-step overhead dominates) and
a medium one (4 x 512), one epoch over the same pre-made batches with:

- ``raw loop``: the hand-written loop (zero_grad, forward, loss, ``loss.item()``,
  backward, step) — ``.item()`` is kept because every real loop reads its loss;
- ``torchgpu loop``: :func:`torchgpu.train.loop.run_epoch` with a GradAccumulator and an
  fp32 Precision, exactly as ``torchgpu train`` runs it;
- ``Lightning Fabric`` and ``Accelerate``: their documented minimal loops, when installed.

Every variant has its own identically seeded model; all are interleaved per round.
The ratio ``X/raw loop`` is the loop's relative cost (the design target: within 1.02).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from torchgpu.bench.result import Plot, SuiteResult
from torchgpu.bench.suites.common import rounds_for, sync_for
from torchgpu.bench.timer import Measurement, measure_interleaved, pairwise_ratios

Batches = list[tuple[Tensor, Tensor]]
RAW, OURS, FABRIC, ACCELERATE = "raw loop", "torchgpu loop", "Lightning Fabric", "Accelerate"


def make_mlp(size: str) -> tuple[nn.Module, int]:
    """(model, input width): ``tiny`` = the housing net, ``medium`` = 4 x 512."""
    torch.manual_seed(0)
    if size == "tiny":
        from torchgpu.models import HousingNet

        return HousingNet(), 13
    layers: list[nn.Module] = []
    width = 512
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1)), width


def make_batches(width: int, batch: int, count: int, device: torch.device) -> Batches:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, width, generator=gen).to(device),
             torch.randn(batch, 1, generator=gen).to(device)) for _ in range(count)]


def raw_loop(size: str, batches: Batches, device: torch.device) -> Callable[[], None]:
    model = make_mlp(size)[0].to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()

    def epoch() -> None:
        model.train()
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.item()
            loss.backward()
            optimizer.step()

    return epoch


def torchgpu_loop(size: str, batches: Batches, device: torch.device) -> Callable[[], None]:
    from torchgpu.accumulate import GradAccumulator
    from torchgpu.precision import Precision
    from torchgpu.train.loop import LoopParts, run_epoch
    from torchgpu.train.state import TrainState

    model = make_mlp(size)[0].to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    precision = Precision("fp32", device)
    acc = GradAccumulator(model, optimizer, steps=1, precision=precision)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc, precision=precision,
                      device=device)

    def epoch() -> None:
        run_epoch(parts, batches, TrainState(), batches_per_epoch=len(batches))

    return epoch


def fabric_loop(size: str, batches: Batches, device: torch.device) -> Callable[[], None]:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=1)
    module = make_mlp(size)[0]
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=1e-3))
    loss_fn = nn.MSELoss()

    def epoch() -> None:
        model.train()
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.item()
            fabric.backward(loss)
            optimizer.step()

    return epoch


def accelerate_loop(size: str, batches: Batches, device: torch.device) -> Callable[[], None]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=device.type != "cuda")
    module = make_mlp(size)[0]
    model, optimizer = accelerator.prepare(module, torch.optim.SGD(module.parameters(), lr=1e-3))
    loss_fn = nn.MSELoss()

    def epoch() -> None:
        model.train()
        for x, y in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.item()
            accelerator.backward(loss)
            optimizer.step()

    return epoch


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def run(quick: bool, devices: Sequence[torch.device], out: Path) -> SuiteResult:
    """One interleaved run per model size; ratios against the raw loop."""
    plan = rounds_for(quick)
    device = devices[0]
    count = 10 if quick else 200
    sizes = {"tiny": 32, "medium": 64 if quick else 256}
    loops: dict[str, Callable[[str, Batches, torch.device], Callable[[], None]]] = {
        RAW: raw_loop, OURS: torchgpu_loop}
    notes = []
    for name, module, loop in ((FABRIC, "lightning", fabric_loop),
                               (ACCELERATE, "accelerate", accelerate_loop)):
        if installed(module):
            loops[name] = loop
        else:
            notes.append(f"{name} rows skipped: `{module}` is not installed "
                         f"(pip install {module}).")
    measurements: list[Measurement] = []
    ratios = []
    for size, batch in sizes.items():
        width = make_mlp(size)[1]
        batches = make_batches(width, batch, count, device)
        variants = {f"{name} ({size})": build(size, batches, device)
                    for name, build in loops.items()}
        timed = measure_interleaved(variants, plan.rounds, plan.warmup, sync_for([device]))
        measurements += [m.with_extra(model=size, batch=batch, batches=count,
                                      step_us=m.median / count * 1e6) for m in timed.values()]
        ratios += pairwise_ratios(timed, [(n, f"{RAW} ({size})") for n in timed
                                          if n != f"{RAW} ({size})"])
    notes.append(f"one sample = one epoch of {count} batches on {device}; step_us = median "
                 "epoch time / batches. Ratio 'X/raw loop' > 1 is X's overhead.")
    plots = [Plot(filename=f"overhead-{size}.png", kind="bar",
                  title=f"{size} MLP: one epoch of {count} batches",
                  ylabel="seconds, median [min..max]",
                  names=tuple(m.name for m in measurements if m.extra["model"] == size))
             for size in sizes]
    return SuiteResult(
        suite="overhead", quick=quick, devices=(str(device),),
        measurements=tuple(measurements), ratios=tuple(ratios), plots=tuple(plots),
        notes=tuple(notes),
        config={"batches_per_epoch": count, "batch_sizes": sizes, "rounds": plan.rounds,
                "warmup": plan.warmup},
    )
