"""BatchNorm for micro-batched pipelines: running statistics of the whole mini-batch.

In a pipeline each BatchNorm layer sees micro-batches. A plain ``nn.BatchNorm``
then (a) normalises with micro-batch statistics and (b) updates its running mean
and variance once per micro-batch, so after one step the running statistics are
those of M small batches, and (c) with activation checkpointing it updates them
again while recomputing in backward.

:class:`DeferredBatchNorm` (as in torchgpipe) keeps (a) — training-time
normalisation still uses each micro-batch's own statistics, so outputs differ from
the full-batch BatchNorm by that much — but replaces (b) and (c): it accumulates the
micro-batches' sums while the pipeline runs its forward (never during recomputation)
and updates the running statistics once per mini-batch, with the full batch's mean
and unbiased variance. Running statistics, hence evaluation outputs, match the
plain model trained on full batches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm whose running statistics are updated once per mini-batch.

    Accumulation happens only while ``tracking`` is True (the pipeline turns it on
    around its forward pass and sets ``micro_batch`` before each stage runs);
    :meth:`commit` folds what was accumulated into ``running_mean`` / ``running_var``
    with the layer's momentum. A layer called ``k`` times per micro-batch (one object
    at several positions of the model) keeps ``k`` accumulators, its ``j``-th call on
    every micro-batch going to the ``j``-th, and commits them in order: ``k`` updates
    of the full batch's statistics, as the plain model makes. The state_dict keys are
    those of ``nn.BatchNorm*`` (the accumulators are not saved).
    """

    tracking: bool
    micro_batch: int

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, True, device=device, dtype=dtype)
        self.tracking = False
        self.micro_batch = 0
        self._calls: dict[int, int] = {}  # micro-batch -> calls tracked on it so far
        # Per call index: [rows, mean, sum of squared deviations from the mean].
        self._acc: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def track(self, input: torch.Tensor) -> None:
        """Fold one call on micro-batch ``self.micro_batch`` into the accumulator of its
        call index (Chan's parallel mean/variance)."""
        call = self._calls.get(self.micro_batch, 0)
        self._calls[self.micro_batch] = call + 1
        dims = [0, *range(2, input.dim())]
        n_b = input.numel() // input.shape[1]
        with torch.no_grad():
            x = input.detach()
            mean_b = x.mean(dims)
            m2_b = x.var(dims, unbiased=False) * n_b
            if call == len(self._acc):
                self._acc.append((n_b, mean_b, m2_b))
                return
            count, mean, m2 = self._acc[call]
            total = count + n_b
            delta = mean_b - mean
            self._acc[call] = (
                total,
                mean + delta * (n_b / total),
                m2 + m2_b + delta * delta * (count * n_b / total),
            )

    def discard(self) -> None:
        """Forget what was tracked and not committed (a forward that failed midway)."""
        self._calls, self._acc = {}, []

    def commit(self) -> bool:
        """Update the running statistics with what was tracked, one update per call
        index; False if nothing was tracked."""
        acc, (self._calls, self._acc) = self._acc, ({}, [])
        if not acc:
            return False
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        with torch.no_grad():
            for count, mean, m2 in acc:
                self.num_batches_tracked.add_(1)
                if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                    factor = 1.0 / float(self.num_batches_tracked.item())
                else:
                    factor = float(self.momentum)
                var = m2 / max(count - 1, 1)
                self.running_mean.mul_(1 - factor).add_(
                    mean.to(self.running_mean.dtype), alpha=factor
                )
                self.running_var.mul_(1 - factor).add_(
                    var.to(self.running_var.dtype), alpha=factor
                )
        return True

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return F.batch_norm(
                input,
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
        if self.tracking:
            self.track(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @classmethod
    def from_batch_norm(cls, bn: _BatchNorm) -> DeferredBatchNorm:
        """A DeferredBatchNorm sharing ``bn``'s parameters and buffers (no copy)."""
        new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, device="meta")
        new.weight, new.bias = bn.weight, bn.bias
        new.running_mean, new.running_var = bn.running_mean, bn.running_var
        new.num_batches_tracked = bn.num_batches_tracked
        new.train(bn.training)
        return new


def convert_deferred_batch_norm(module: nn.Module) -> list[DeferredBatchNorm]:
    """Replace, in place, every BatchNorm with running statistics inside ``module`` by a
    :class:`DeferredBatchNorm` sharing its tensors; every reference to a layer (it may
    sit in several containers) gets the same replacement. Returns the deferred layers."""
    replaced: dict[int, DeferredBatchNorm] = {}
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if isinstance(child, DeferredBatchNorm):
                replaced.setdefault(id(child), child)
            elif (
                isinstance(child, _BatchNorm)
                and child.track_running_stats
                and not isinstance(child, nn.SyncBatchNorm)
            ):
                if id(child) not in replaced:
                    replaced[id(child)] = DeferredBatchNorm.from_batch_norm(child)
                parent._modules[name] = replaced[id(child)]
    return list(replaced.values())


def deferred_layers(module: nn.Module) -> list[DeferredBatchNorm]:
    """The DeferredBatchNorm layers inside ``module``."""
    return [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]


@contextmanager
def tracking(layers: list[DeferredBatchNorm]) -> Iterator[None]:
    """Accumulate micro-batch statistics in ``layers`` inside the block (the pipeline's
    forward), not outside it (recomputation during backward)."""
    for layer in layers:
        layer.discard()  # what a failed forward left behind is not this batch's
        layer.tracking = True
        layer.micro_batch = 0
    try:
        yield
    finally:
        for layer in layers:
            layer.tracking = False
