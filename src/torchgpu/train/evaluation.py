"""Evaluation on the held-out split: :func:`evaluate` and its :class:`EvalResult`.

Once per epoch, off the hot path: the model in eval mode, sums in float64 on the CPU,
R² (regression), accuracy (classification) or a task's own metrics.
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
from torchgpu.transfer import to_device

LossFn = Callable[[Any, Any], Tensor]


class Autocaster(Protocol):
    """What evaluation needs from :class:`torchgpu.precision.Precision`."""

    def autocast(self) -> AbstractContextManager[Any]: ...


@dataclass(frozen=True)
class EvalResult:
    """Held-out metrics: mean loss, and R² (regression) or accuracy (classification)."""

    loss: float
    r2: float | None
    accuracy: float | None
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)  # a user task's, by name



@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: LossFn,
    *,
    task: str,
    device: torch.device,
    precision: Autocaster | None = None,
    target_device: torch.device | None = None,
    metrics: Mapping[str, Callable[[Any, Any], float]] | None = None,
) -> EvalResult:
    """Mean loss over ``batches`` plus R² (``task="regression"``), accuracy
    (``"classification"``) or ``metrics`` (``{name: fn(output, target) -> float}``, each
    batch's value weighted by its samples; ``"custom"``).

    Batches are ``(inputs, target)`` of any structure (:mod:`torchgpu.data.batches`).
    Sums are kept in float64 on the CPU; the model is put in eval mode and back into
    train mode afterwards. Labels go to ``target_device`` (default ``device``: where the
    output is). The caller chooses which batches (all ranks may evaluate
    the full held-out split; it is small and the result is then identical everywhere).
    """
    was_training = model.training
    model.eval()
    loss_total = 0.0
    count = 0
    sse = sum_y = sum_y2 = 0.0
    correct = 0
    sums = dict.fromkeys(metrics or {}, 0.0)
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
            for name, fn in (metrics or {}).items():
                sums[name] += float(fn(out, y)) * n
            if task == "regression":
                target = y.double().reshape(out.shape)
                sse += float(((out.double() - target) ** 2).sum())
                sum_y += float(target.sum())
                sum_y2 += float((target**2).sum())
            elif task == "classification":
                correct += int((out.argmax(dim=1) == y).sum())
    finally:
        model.train(was_training)
    if count == 0:
        return EvalResult(math.nan, None, None, 0, {k: math.nan for k in sums})
    averaged = {k: v / count for k, v in sums.items()}
    if task == "regression":
        total = sum_y2 - sum_y * sum_y / count
        r2 = 1.0 - sse / total if total > 0 else math.nan
        return EvalResult(loss_total / count, r2, None, count, averaged)
    if task == "classification":
        return EvalResult(loss_total / count, None, correct / count, count, averaged)
    return EvalResult(loss_total / count, None, None, count, averaged)
