"""Seed 002's timed unit, shared by ``parallel`` and ``split-sweep``: one run trains a
ResNet-50 for a few batches of random images against one-hot labels with MSE and SGD.

Differences from the seed, on purpose: the random batches are made once, before timing,
and reused by every variant (so each variant sees identical data and the RNG is not
timed); every run ends with a device synchronise (the seed's timeit stopped the clock
while GPU work could still be queued).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from torchgpu.models import resnet50
from torchgpu.models.resnet import ResNet

RESNET50_BLOCKS = (3, 4, 6, 3)


@dataclass(frozen=True)
class ResNetRun:
    """Sizes of one timed run (the seed: batch 120, 128x128 images, 3 batches, 1000 classes).

    ``blocks``: Bottleneck blocks per stage; (3, 4, 6, 3) is ResNet-50. ``--quick`` runs
    use one block per stage: the same layer types and code paths in a quarter of the
    layers, so CI keeps the path alive in seconds.
    """

    batch_size: int
    image_px: int
    num_batches: int
    num_classes: int
    blocks: tuple[int, int, int, int] = RESNET50_BLOCKS

    @property
    def model_name(self) -> str:
        if tuple(self.blocks) == RESNET50_BLOCKS:
            return "ResNet-50"
        return f"ResNet ({'-'.join(map(str, self.blocks))} blocks)"

    def chunks_for(self, split_size: int) -> int:
        """Micro-batches for a split size (samples per micro-batch): ceil(batch / split)."""
        return math.ceil(self.batch_size / split_size)


SEED_RUN = ResNetRun(batch_size=120, image_px=128, num_batches=3, num_classes=1000)
QUICK_RUN = ResNetRun(batch_size=8, image_px=32, num_batches=1, num_classes=10,
                      blocks=(1, 1, 1, 1))
# `--size medium`: the seed's model, batch and classes at 64x64 and one batch per run, so a
# CPU-only machine measures the same experiment in minutes instead of hours.
MEDIUM_RUN = ResNetRun(batch_size=120, image_px=64, num_batches=1, num_classes=1000)
SIZES = ("full", "medium")


def run_for(quick: bool, size: str = "full") -> ResNetRun:
    """The sizes of one timed run: quick, the seed's (``full``) or ``medium``."""
    if quick:
        return QUICK_RUN
    return MEDIUM_RUN if size == "medium" else SEED_RUN


def make_batches(run: ResNetRun, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_batches`` CPU (inputs, one-hot labels) pairs, the seed's way."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, run.num_classes, (run.batch_size, 1), generator=gen)
    labels = torch.zeros(run.batch_size, run.num_classes).scatter_(1, indices, 1.0)
    return [
        (torch.randn(run.batch_size, 3, run.image_px, run.image_px, generator=gen), labels)
        for _ in range(run.num_batches)
    ]


def base_model(run: ResNetRun, seed: int = 0) -> nn.Module:
    """The run's ResNet seeded with ``seed``: every variant builds its own with the same
    weights (building is cheaper than ``copy.deepcopy``)."""
    torch.manual_seed(seed)
    blocks = tuple(run.blocks)
    assert len(blocks) == 4
    return ResNet((blocks[0], blocks[1], blocks[2], blocks[3]), num_classes=run.num_classes)


def input_device_of(model: nn.Module) -> torch.device:
    """Where inputs go: a split model's first stage, else the first parameter's device."""
    device = getattr(model, "input_device", None)
    if isinstance(device, torch.device):
        return device
    devices = getattr(model, "devices", None)
    if devices:
        return torch.device(devices[0])
    return next(model.parameters()).device


def train_run(
    model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> Callable[[], None]:
    """The seed's ``train(model)``: one call trains on every batch once."""
    model.train(True)
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    device = input_device_of(model)

    def run() -> None:
        for inputs, labels in batches:
            optimizer.zero_grad()
            outputs = model(inputs.to(device))
            loss_fn(outputs, labels.to(outputs.device)).backward()
            optimizer.step()

    return run


def flat_layers(model: nn.Module) -> nn.Sequential:
    """ResNet-50 as 18 layers (stem, 16 bottleneck blocks, head) sharing the model's modules:
    fine enough to cut into many checkpoint segments (``as_sequential`` has 6)."""
    view = model.as_sequential()  # type: ignore[operator]
    layers: list[nn.Module] = []
    for child in view.children():
        layers += list(child.children()) if isinstance(child, nn.Sequential) else [child]
    return nn.Sequential(*layers)


def peak_bytes(device: torch.device, fn: Callable[[], None]) -> int | None:
    """Peak bytes allocated on a CUDA ``device`` while ``fn`` runs (None on CPU)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device))


@dataclass(frozen=True)
class Workload:
    """A model with one batch of inputs and class labels, for the memory suites."""

    name: str
    model: nn.Sequential
    inputs: torch.Tensor
    labels: torch.Tensor


def workload(quick: bool, batch_size: int, image_px: int, device: torch.device,
             seed: int = 0) -> Workload:
    """Full size: ResNet-50 as 18 layers on ``image_px`` images (1000 classes). Quick: a
    16-layer MLP of width 128 (10 classes), so the code path runs in well under a second."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    if quick:
        width, depth, classes = 128, 16, 10
        layers: list[nn.Module] = [nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                   for _ in range(depth - 1)]
        model = nn.Sequential(*layers, nn.Linear(width, classes))
        inputs = torch.randn(batch_size, width, generator=gen)
        name = f"MLP {depth}x{width}"
    else:
        classes = 1000
        model = flat_layers(resnet50(num_classes=classes))
        inputs = torch.randn(batch_size, 3, image_px, image_px, generator=gen)
        name = f"ResNet-50 ({len(model)} layers) at {image_px}x{image_px}"
    labels = torch.randint(0, classes, (batch_size,), generator=gen)
    return Workload(name, model.to(device), inputs.to(device), labels.to(device))
