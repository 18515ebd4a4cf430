"""Evaluation on the held-out split: :func:`evaluate` and its ``EvalResult``.

Once per epoch, off the hot path: the model in eval mode, the loss summed in float64 on
the CPU, and the task's metrics (:mod:`torchgpu.train.metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from torchgpu.data.batches import batch_rows
from torchgpu.train.metrics import MetricLike, Tally
from torchgpu.transfer import to_device

LossFn = Callable[[Any, Any], Tensor]


class Autocaster(Protocol):
    """What evaluation needs from :class:`torchgpu.precision.Precision`."""

    def autocast(self) -> AbstractContextManager[Any]: ...


@dataclass(frozen=True)
class EvalResult:
    """Held-out results: the mean loss, the samples seen and the task's metrics by name."""

    loss: float
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: LossFn,
    *,
    device: torch.device,
    precision: Autocaster | None = None,
    target_device: torch.device | None = None,
    metrics: Mapping[str, MetricLike] | None = None,
) -> EvalResult:
    """Mean loss over ``batches`` and ``metrics`` (:mod:`torchgpu.train.metrics`: a
    function ``fn(output, target) -> float`` averaged over the samples, each batch
    weighted by its rows, or an object reset here, updated per batch and computed at the
    end; NaN when there were no samples).

    Batches are ``(inputs, target)`` of any structure (:mod:`torchgpu.data.batches`).
    The loss is summed in float64 on the CPU; a tensor output is cast to float32 before
    the loss and the metrics see it. The model is put in eval mode and back into train
    mode afterwards. Labels go to ``target_device`` (default ``device``: where the
    output is). The caller chooses which batches (all ranks may evaluate
    the full held-out split; it is small and the result is then identical everywhere).
    """
    was_training = model.training
    model.eval()
    loss_total = 0.0
    count = 0
    tally = Tally(metrics)
    try:
        for x, y in batches:
            n = int(x.shape[0]) if isinstance(x, Tensor) else batch_rows(x)
            if n == 0:
                continue
            same = y is x  # a dict batch is its own target (DictPairs)
            x = to_device(x, device)
            y = x if same else to_device(
                y, target_device if target_device is not None else device)
            if precision is not None:
                with precision.autocast():
                    out = model(x)
            else:
                out = model(x)
            if isinstance(out, Tensor):
                out = out.float()
            loss_total += float(loss_fn(out, y)) * n
            count += n
            tally.update(out, y, n)
    finally:
        model.train(was_training)
    return EvalResult(loss_total / count if count else math.nan, count, tally.results())
