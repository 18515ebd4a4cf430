"""What the suites share: which devices to use, how to synchronise them, sizes per mode."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchgpu.bench.timer import cuda_sync


@dataclass(frozen=True)
class Rounds:
    """How many untimed warm-up calls and timed rounds a suite makes."""

    warmup: int
    rounds: int


QUICK = Rounds(warmup=1, rounds=2)
MEDIUM = Rounds(warmup=1, rounds=5)
FULL = Rounds(warmup=2, rounds=10)


def rounds_for(quick: bool, size: str = "full") -> Rounds:
    """Warm-up and rounds for a suite run at ``--quick``, ``--size medium`` or full size."""
    if quick:
        return QUICK
    return MEDIUM if size == "medium" else FULL


def gpus(devices: Sequence[torch.device]) -> list[torch.device]:
    """The CUDA devices among ``devices``, in order, without duplicates."""
    seen: list[torch.device] = []
    for d in devices:
        if d.type == "cuda" and d not in seen:
            seen.append(d)
    return seen


def sync_for(devices: Sequence[torch.device]) -> Callable[[], None] | None:
    """A sync for :func:`~torchgpu.bench.timer.measure_interleaved`, or None on CPU only."""
    return cuda_sync(devices) if gpus(devices) else None


def device_pair(devices: Sequence[torch.device]) -> tuple[list[torch.device], str]:
    """Two devices for a model split, and a label: two GPUs, one GPU twice, or CPU twice."""
    cuda = gpus(devices)
    if len(cuda) >= 2:
        return cuda[:2], "two GPUs"
    if len(cuda) == 1:
        return [cuda[0], cuda[0]], "one GPU twice"
    return [torch.device("cpu"), torch.device("cpu")], "CPU twice"


def seed_all(seed: int = 0) -> None:
    torch.manual_seed(seed)
