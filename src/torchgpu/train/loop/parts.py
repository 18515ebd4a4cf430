"""The pieces the training loop works with: :class:`LoopParts` (one micro-step's model,
loss, accumulator, precision, device and hooks) and the protocols it needs from them.

A leaf of the loop's modules: the epoch loop, its micro-step and its window all read
these types, so they live apart from each of them.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from torchgpu.train.guards.agreement import RankAgreement
from torchgpu.train.loop.outcome import BatchOutcome
from torchgpu.train.state import TrainState

if TYPE_CHECKING:
    from torchgpu.data.shards import ShardLayout
    from torchgpu.train.loop.backoff import LoopBackoff


class Window(Protocol):
    """The accumulation window the loop sizes, steps at the epoch's end and drops: what it
    needs from :class:`torchgpu.accumulate.GradAccumulator` or a strategy's own window."""

    @property
    def steps(self) -> int: ...

    def set_steps(self, steps: int, window_samples: float | None = None) -> None: ...

    @property
    def window_samples(self) -> float | None: ...

    def reset(self) -> None: ...

    def zero_grad(self) -> None: ...

    def flush(self) -> bool: ...

    @property
    def pending(self) -> int: ...


@runtime_checkable
class Accumulator(Window, Protocol):
    """A window that also runs each micro-batch's backward and steps at its boundary (what
    :class:`~torchgpu.train.loop.micro_step.MicroStep` needs: a ``GradAccumulator``)."""

    def micro_step(self) -> AbstractContextManager[Any]: ...

    def backward(self, loss: Tensor, samples: int | None = None) -> bool: ...


class Autocaster(Protocol):
    """What the loop needs from :class:`torchgpu.precision.Precision`."""

    def autocast(self) -> AbstractContextManager[Any]: ...


class ProgressSink(Protocol):
    """What the loop reports to (see :mod:`torchgpu.train.observe.progress`); called ≤ 10 Hz."""

    def update(self, state: TrainState, loss: float, samples_per_s: float) -> None: ...


LossFn = Callable[[Tensor, Tensor], Tensor]

# One micro-batch's result: its loss (None while still on the device), whether it was
# non-finite, whether the optimizer stepped, and the back-off's or the guard's outcome
# when one took the batch over.
StepResult = tuple[float | None, bool, bool, BatchOutcome | None]


class OwnStep(Protocol):
    """A strategy's own micro-step, for a batch that is no forward-then-backward of one
    module (the multi-process stage pipeline: one schedule over every stage)."""

    def __call__(self, x: Any, y: Any, samples: int, loss_fn: LossFn) -> StepResult: ...


@dataclass(frozen=True)
class LoopParts:
    """The pieces one micro-step uses. ``agree`` = several ranks decide together."""

    model: nn.Module
    loss_fn: LossFn
    # The GradAccumulator; with ``step``, the strategy's own window.
    accumulator: Window
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
    # The strategy's own micro-step, which the loop then runs instead of MicroStep (the
    # stage pipeline); None: forward, loss and backward through ``accumulator``.
    step: OwnStep | None = None

    def __post_init__(self) -> None:
        if self.step is not None and (self.agree or self.backoff is not None
                                      or self.layout is not None):
            raise TypeError("LoopParts.step (a strategy's own step) runs without the loop's "
                            "DDP agreement, OOM back-off and sample-weighted tail: leave "
                            "agree, backoff and layout unset")
        if self.agree and self.agreement is None:
            import torch.distributed as dist  # only under DDP: the group exists

            object.__setattr__(self, "agreement", RankAgreement(dist.get_world_size()))
