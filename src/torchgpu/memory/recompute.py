"""Running a piece of a model under activation checkpointing so that it computes what
the plain model computes.

The one helper behind both kinds of checkpointing in torchgpu: a pipeline's
checkpointed micro-batches (:class:`~torchgpu.parallel.pipeline.Pipeline`) and
:func:`~torchgpu.memory.activation_checkpointing.apply_activation_checkpointing`'s
segments and blocks. :func:`checkpointed` runs a function under
``torch.utils.checkpoint`` (``use_reentrant=False``, RNG state preserved) through a
:class:`Recompute`, which fixes what plain checkpointing gets wrong:

- Every run (the forward and each recomputation in backward) gets a copy of the tensor
  inputs. The recomputation re-reads the inputs, so the piece must not change them: an
  in-place first layer (``ReLU(inplace=True)``, ``x.mul_(2)``) would otherwise modify a
  tensor autograd saved ("modified by an inplace operation") or feed the recomputation a
  modified input (wrong gradients). The copy lives only while the piece runs
  (checkpointing keeps none of its intermediates); gradients flow through it unchanged.
  (The one visible difference from the plain model: an in-place change to the caller's
  own input tensor is not made to it.)
- A recomputation leaves running statistics alone (:func:`running_stats_frozen`): the
  plain model runs each layer once per batch, so BatchNorm's running mean, variance and
  ``num_batches_tracked`` must move once, not again in backward.
- Outside training mode, or with gradients disabled, nothing is recomputed (as in
  torchgpipe): there is no backward to save memory for, so the piece runs plainly.
- Under ``torch.compile`` the piece is checkpointed plainly, for the compiler to trace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchgpu.parallel.batchnorm import DeferredBatchNorm
from torchgpu.parallel.microbatch import map_tensors

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


class Recompute:
    """What a checkpointed piece runs: its first call is the forward, any later call a
    recomputation in backward. Each call runs ``function`` on copies of the tensors in
    its arguments; a recomputation runs with the running statistics of the norm layers
    in ``owner`` frozen."""

    def __init__(self, function: Callable[..., Any], owner: nn.Module) -> None:
        self.function = function
        self.owner = owner
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        args, kwargs = map_tensors(torch.clone, (args, kwargs))
        if self.calls == 1:
            return self.function(*args, **kwargs)
        with running_stats_frozen(self.owner):
            return self.function(*args, **kwargs)


def recomputes(owner: nn.Module) -> bool:
    """Whether a checkpointed piece of ``owner`` recomputes now: in training mode with
    gradients enabled (in eval mode or under ``no_grad`` there is no backward)."""
    return owner.training and torch.is_grad_enabled()


def checkpointed(owner: nn.Module, function: Callable[..., Any], *args: Any,
                 **kwargs: Any) -> Any:
    """``function(*args, **kwargs)`` -- a piece of ``owner`` -- under checkpoint through a
    :class:`Recompute` when :func:`recomputes`, else called plainly."""
    if not recomputes(owner):
        return function(*args, **kwargs)
    if torch.compiler.is_compiling():
        # Under torch.compile the checkpoint is traced as one operator whose recompute
        # the compiler plans: a Recompute's call count is a side effect dynamo refuses
        # (it would run the whole forward eagerly), and the compiled graph needs none of
        # its fixes (in-place ops and running statistics are functionalised, updated once).
        return checkpoint(function, *args, use_reentrant=False, **kwargs)
    return checkpoint(Recompute(function, owner), *args, use_reentrant=False,
                      preserve_rng_state=True, **kwargs)


@contextmanager
def running_stats_frozen(module: nn.Module) -> Iterator[None]:
    """Inside the block, normalisation layers in training mode inside ``module`` leave
    their running statistics as they are, and normalise exactly as before.

    The kernels still receive the running buffers (the recomputation must save the
    same tensors for backward as the forward did, or checkpointing refuses), so the
    update is made a no-op instead: momentum 0 (``running = 1 * running + 0 * batch``)
    and, for BatchNorm, no ``num_batches_tracked`` to count up. DeferredBatchNorm
    needs none of this (it accumulates only while the pipeline's forward tracks).
    """
    changed: list[tuple[nn.Module, str, object]] = []
    try:
        for m in module.modules():
            if not (
                isinstance(m, _NORMS)
                and m.training
                and m.track_running_stats
                and not isinstance(m, DeferredBatchNorm)
            ):
                continue
            changed.append((m, "momentum", m.momentum))
            m.momentum = 0.0
            if getattr(m, "num_batches_tracked", None) is not None:
                changed.append((m, "num_batches_tracked", m.num_batches_tracked))
                m.num_batches_tracked = None
        yield
    finally:
        for m, name, value in reversed(changed):
            setattr(m, name, value)
