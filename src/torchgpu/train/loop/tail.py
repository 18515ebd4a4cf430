"""The epoch's last windows: micro-batches weighted by their samples.

Equal weights (``loss / steps`` per micro-batch, DDP's plain mean over ranks) are exact only
while every micro-batch on every rank is full, but the epoch's last global batch is usually
short (under DDP a rank may hold none of it). From the first window that can reach a short
batch, :class:`TailWindows` gives the accumulator each window's sample count and the loop
weights each micro-batch by its samples, so the step equals one process's step on the big
batch, and the logged losses get the matching weights. Before that point the loop runs
unchanged (nothing is computed per step).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from torch import Tensor

from torchgpu.data.batches import is_empty, zero_loss_like
from torchgpu.data.shards import ShardLayout

LossFn = Callable[[Any, Any], Tensor]


class EmptySafeLoss:
    """``loss_fn``, except that a batch of zero rows gets a loss of exactly zero that is
    still connected to every parameter the forward used (so DDP's all-reduce sees a
    zero gradient from this rank instead of a NaN mean over no samples)."""

    def __init__(self, loss_fn: LossFn) -> None:
        self.loss_fn = loss_fn

    def __call__(self, out: Any, target: Any) -> Tensor:
        if isinstance(out, Tensor):
            if out.shape[0] == 0:
                return out.sum() * 0.0
        elif is_empty(target):  # a structured output (e.g. with .logits) of no rows
            zero = zero_loss_like(out)
            if zero is not None:
                return zero
        return self.loss_fn(out, target)


class TailWindows:
    """The loop's sample weighting for one epoch.

    ``layout``: how the epoch's batches fall on the ranks (None: the loop's batches
    are not described, nothing is weighted). ``window``: micro-batches per optimizer
    step. ``start``: the first local batch index the loop must call :meth:`batch` for.
    """

    def __init__(self, layout: ShardLayout | None, window: int, batches_per_epoch: int,
                 loss_fn: LossFn) -> None:
        self.layout = layout
        self.window = window
        self.batches_per_epoch = batches_per_epoch
        self.loss_fn: LossFn = EmptySafeLoss(loss_fn)
        if layout is None or layout.first_short >= layout.batches:
            self.start = sys.maxsize
        else:  # a window of at most ``window`` batches starting earlier ends before it
            self.start = max(0, layout.first_short - window + 1)

    def batch(self, accumulator: Any, index: int, samples: int) -> float:
        """Local batch ``index`` of ``samples`` samples is next. At a window's start, set
        the window's length (the epoch's last window is what is left) and its sample
        count on ``accumulator``. Returns the factor for this batch's logged loss (1.0
        in one process)."""
        layout = self.layout
        assert layout is not None
        if accumulator.pending == 0:
            left = self.batches_per_epoch - index
            wanted = left if 0 < left < self.window else self.window
            accumulator.set_steps(wanted, layout.window_share(index, wanted))
        return layout.loss_weight(index, samples)
