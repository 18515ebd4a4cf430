"""The pieces the training loop works with: :class:`LoopParts` (one micro-step's model,
loss, accumulator, precision, device and hooks) and the protocols it needs from them.

A leaf of the loop's modules: :mod:`torchgpu.train.loop.epoch`, its micro-step
(:mod:`torchgpu.train.loop.micro_step`) and its window (:mod:`torchgpu.train.loop.window`) all read
these types, so they live apart from each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from torchgpu.train.guards.agreement import RankAgreement
from torchgpu.train.state import TrainState

if TYPE_CHECKING:
    from torchgpu.data.shards import ShardLayout
    from torchgpu.train.loop.backoff import LoopBackoff


class Accumulator(Protocol):
    """What the loop needs from :class:`torchgpu.accumulate.GradAccumulator`."""

    @property
    def steps(self) -> int: ...

    def micro_step(self) -> AbstractContextManager[Any]: ...

    def backward(self, loss: Tensor, samples: int | None = None) -> bool: ...

    def set_steps(self, steps: int, window_samples: float | None = None) -> None: ...

    @property
    def window_samples(self) -> float | None: ...

    def reset(self) -> None: ...

    def zero_grad(self) -> None: ...

    def flush(self) -> bool: ...

    @property
    def pending(self) -> int: ...


class Autocaster(Protocol):
    """What the loop needs from :class:`torchgpu.precision.Precision`."""

    def autocast(self) -> AbstractContextManager[Any]: ...


class ProgressSink(Protocol):
    """What the loop reports to (see :mod:`torchgpu.train.observe.progress`); called ≤ 10 Hz."""

    def update(self, state: TrainState, loss: float, samples_per_s: float) -> None: ...


LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class LoopParts:
    """The pieces one micro-step uses. ``agree`` = several ranks decide together."""

    model: nn.Module
    loss_fn: LossFn
    accumulator: Accumulator
    precision: Autocaster
    device: torch.device
    accumulate: int = 1  # micro-batches per optimizer step (the configured window)
    move_batches: bool = False  # copy each batch to ``device`` (False: already there)
    on_nonfinite: str = "stop"  # "stop" | "skip"
    rank: int = 0
    agree: bool = False
    # Labels' device when the output is not on ``device`` (model/pipeline: the last
    # stage's device, ``model.output_device``); None = leave labels where they are.
    target_device: torch.device | None = None
    # OOM back-off (None: an out-of-memory error propagates). See torchgpu.train.loop.backoff.
    backoff: LoopBackoff | None = None
    # DDP agreement on stop/losses, kept across epochs (its adaptive period) and reached
    # by on_step hooks through sync_now(parts); made here under ``agree`` when None.
    agreement: RankAgreement | None = None
    # How the epoch's samples fall on the ranks (torchgpu.data.shards): from the first
    # window holding a short micro-batch on, micro-batches are weighted by their samples
    # (torchgpu.train.loop.tail). None: equal weights (exact when all batches are full).
    layout: ShardLayout | None = None

    def __post_init__(self) -> None:
        if self.agree and self.agreement is None:
            import torch.distributed as dist  # only under DDP: the group exists

            object.__setattr__(self, "agreement", RankAgreement(dist.get_world_size()))
