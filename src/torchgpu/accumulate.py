"""Gradient accumulation: k micro-batches that train exactly like one k-times-larger batch.

Each micro-batch's loss is divided by k before ``backward``, so after k micro-steps the
summed gradients are the gradient of the mean loss over the big batch. That holds when
the micro-batches are equally large; for a window whose micro-batches differ (the
epoch's short last batch), give the window's sample count to :meth:`set_steps`
(``window_samples``) and each micro-batch's to :meth:`backward` (``samples``): each loss
is then weighted by its share of the window's samples, which is again exactly the big
batch's mean. Under DistributedDataParallel the gradient all-reduce is skipped
(``no_sync``) on the k-1 non-boundary micro-steps; the boundary step all-reduces the
accumulated sum once.

DDP decides at a forward whether the *next backward* all-reduces (the first backward
after a forward outside ``no_sync`` reduces the whole accumulated ``.grad``). The
accumulator watches each DDP forward, so it knows at each backward whether DDP reduced
in it. When the window's last backward was not such a one -- all forwards run before
their backwards, forwards outside ``micro_step``, a mixture -- the window's gradients
are all-reduced by hand before the step (averaging is linear, so parts DDP already
averaged stay right) and DDP is asked to broadcast its buffers at the next forward, as
after one of its own synchronised steps: every order steps on the same gradients on
every rank; the interleaved one overlaps DDP's all-reduce with the backward.

Usage, per micro-batch (the forward inside ``micro_step``: DDP decides at forward time
whether the coming backward all-reduces, and overlaps it with that backward)::

    acc = GradAccumulator(model, optimizer, steps=4, precision=prec, clip_norm=1.0)
    for x, y in loader:
        with acc.micro_step():
            with prec.autocast():
                loss = loss_fn(model(x), y)
            stepped = acc.backward(loss)
    acc.flush()   # the last, partial window of the epoch

Micro-batches of unequal size: ``acc.set_steps(3, window_samples=8 + 8 + 4)`` at the
window's start, then ``acc.backward(loss, samples=len(x))``. Under DDP/FSDP
``window_samples`` is the window's samples over all ranks divided by the world size
(ranks may hold different numbers of samples, or none). FSDP2 models reduce-scatter on
every micro-step: skipping it would keep full unsharded gradients on every rank.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from torchgpu.errors import ConfigError, UsageError
from torchgpu.parallel.data import find_ddp
from torchgpu.precision import Precision

#: What a loss without gradients is, and the fix (the probe of a user's task says it too).
NO_GRADIENT = (
    "does not require gradients (requires_grad=False, no grad_fn): backward cannot reach "
    "the weights through it. Compute the loss from the model's output with torch "
    "operations, without .detach(), .item(), torch.tensor(...), NumPy or torch.no_grad() "
    "on the way."
)


def _check_steps(steps: object) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(
            f"accumulation steps must be an integer >= 1, got {steps!r}: use e.g. "
            "--accumulate 4 to sum 4 micro-batches per optimizer step (1 = no accumulation)."
        )
    return steps


class GradAccumulator:
    """Accumulates gradients over ``steps`` micro-batches, then clips, steps and zeroes.

    ``precision``: a :class:`~torchgpu.precision.Precision` whose scaler (fp16) is used
    for backward, unscale and step. ``clip_norm``: max total gradient norm, applied to
    the unscaled gradients at each boundary (``None`` = no clipping).

    ``zero_after_step``: free the gradients right after each step (the default: they
    are None between windows). False: keep them until :meth:`zero_grad`, which a
    training loop calls just before the next window's first forward -- the order of a
    hand-written loop (``zero_grad(); forward; backward; step``). Freeing them right
    after the step instead was measured ~6-9% slower per step on a 4x512 MLP on CPU:
    glibc returns the freed blocks to the OS and the next backward faults them back in.
    A :meth:`backward` on kept gradients zeroes them first, so they never leak into the
    next window.

    Read-only state: ``steps`` (window length), ``window_samples`` (the window's sample
    count for sample weighting, or None), ``pending`` (micro-steps in the current
    window), ``skipped_steps`` (optimizer steps the GradScaler skipped for inf/NaN
    gradients), ``optimizer_steps`` (steps really applied), ``last_grad_norm`` (the
    total norm before clipping at the last boundary, a tensor, or None), ``scales_loss``
    (a loss scaler, fp16's GradScaler, runs backward, unscale and step)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        steps: int,
        precision: Precision | None = None,
        clip_norm: float | None = None,
        *,
        zero_after_step: bool = True,
    ) -> None:
        self._steps = _check_steps(steps)
        if clip_norm is not None and (
            isinstance(clip_norm, bool) or not math.isfinite(float(clip_norm)) or clip_norm <= 0
        ):
            raise ConfigError(
                f"clip_norm must be a positive finite number or None, got {clip_norm!r}: "
                "use e.g. clip_norm=1.0, or None to disable gradient clipping."
            )
        self.model = model
        self.optimizer = optimizer
        self.precision = precision
        # Only a loss scaler (fp16) changes backward, unscale and step: without one they
        # are the plain calls, made directly (three Python calls fewer per step).
        self._scaling: Precision | None = (
            precision if precision is not None and getattr(precision, "scaler", True)
            is not None else None)
        self.clip_norm: float | None = None if clip_norm is None else float(clip_norm)
        self.scales_loss = self._scaling is not None  # read-only
        self._plain_step = self._scaling is None and not zero_after_step
        self._ddp = find_ddp(model)
        # DDP arms its reducer at a forward run outside no_sync; the next backward then
        # all-reduces. Watching its forwards tells each backward whether it did.
        self._armed = False
        if self._ddp is not None:
            self._watch_forwards(self._ddp)
        # micro-steps in the current window (read-only for callers; a plain attribute,
        # not a property: the training loop reads it twice per step)
        self.pending = 0
        self._window_samples: float | None = None
        self._seen_samples = 0  # samples given to backward() in this window
        self._unsynced = False  # the window's last backward was not all-reduced by DDP
        self._skipped = 0
        self._applied = 0
        self.last_grad_norm: torch.Tensor | None = None
        self._zero_after_step = zero_after_step
        self._stale = False  # the last step's gradients are still held (zero_after_step=False)

    def _watch_forwards(self, ddp: DistributedDataParallel) -> None:
        """Record after each DDP forward whether DDP armed its reducer (its own test:
        gradients enabled and ``require_backward_grad_sync``, which ``no_sync`` clears)."""
        owner = weakref.ref(self)  # the hook must not keep a dropped accumulator alive

        def seen(module: nn.Module, args: Any, output: Any) -> None:
            acc = owner()
            if acc is not None and torch.is_grad_enabled() and ddp.require_backward_grad_sync:
                acc._armed = True

        handle = ddp.register_forward_hook(seen)
        weakref.finalize(self, handle.remove)

    @property
    def steps(self) -> int:
        return self._steps

    @property
    def window_samples(self) -> float | None:
        return self._window_samples

    @property
    def skipped_steps(self) -> int:
        return self._skipped

    @property
    def optimizer_steps(self) -> int:
        return self._applied

    def set_steps(self, steps: int, window_samples: float | None = None) -> None:
        """Change the window length; only between windows (``pending == 0``).

        ``window_samples``: the samples the coming window holds (over all ranks divided
        by the world size under DDP/FSDP). With it, :meth:`backward` weights a loss given
        with ``samples=n`` by ``n / window_samples`` instead of ``1 / steps``. ``None``
        (the default, also what this call restores) weights every micro-batch alike.
        """
        steps = _check_steps(steps)
        if window_samples is not None and not (
            math.isfinite(float(window_samples)) and window_samples > 0
        ):
            raise ConfigError(
                f"window_samples must be a positive finite number or None, got "
                f"{window_samples!r}: pass the window's sample count (over all ranks divided "
                "by the world size under DDP), or None to weight micro-batches alike."
            )
        if self.pending:
            raise ConfigError(
                f"set_steps({steps}) called in the middle of a window ({self.pending} of "
                f"{self._steps} micro-steps pending): call it right after a step, after "
                "flush(), or after reset()."
            )
        self._steps = steps
        self._window_samples = None if window_samples is None else float(window_samples)

    def zero_grad(self) -> None:
        """Free (set to None) the gradients the last step left, if any
        (``zero_after_step=False``: call it just before the next window's first forward)."""
        if self._stale:
            self.optimizer.zero_grad(set_to_none=True)
            self._stale = False

    def reset(self) -> None:
        """Drop the current window: zero (set to None) all gradients. The window's
        length and ``window_samples`` stay (a replayed window uses them again)."""
        self.optimizer.zero_grad(set_to_none=True)
        self._stale = False
        self.pending = 0
        self._seen_samples = 0
        self._unsynced = False
        self._armed = False  # a dropped forward's arming is not trusted

    def loss_scale(self, samples: int | None = None) -> float:
        """The factor :meth:`backward` multiplies a loss of ``samples`` samples by:
        ``samples / window_samples`` when both are known, else ``1 / steps``."""
        if samples is not None and self._window_samples is not None:
            return samples / self._window_samples
        return 1.0 / self._steps

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[bool]:
        """Context for one micro-batch's forward and backward; yields whether this
        micro-step closes the window. Under DDP, non-boundary micro-steps run in
        ``no_sync()`` so their backward does not all-reduce. Forwards may also run ahead
        of their backwards (see the module docstring)."""
        boundary = self.pending + 1 >= self._steps
        if self._ddp is None:
            yield boundary
            return
        try:
            if boundary:
                yield boundary
            else:
                with self._ddp.no_sync():
                    yield boundary
        except BaseException:
            # A failed step's arming, if DDP got that far, is not trusted: the window's
            # end then all-reduces by hand (harmless where DDP reduced as well).
            self._armed = False
            raise

    def backward(self, loss: torch.Tensor, samples: int | None = None) -> bool:
        """Backward of ``loss / steps``; at the window's end, step the optimizer.

        ``samples``: how many samples ``loss`` is the mean over. When the window's
        ``window_samples`` was given to :meth:`set_steps`, the backward is of
        ``loss * samples / window_samples`` instead (the micro-batch's share of the
        window), so micro-batches of different sizes (a short one, or an empty one on a
        DDP rank, whose loss must then be a finite zero) add up to the window's mean.
        Without ``window_samples`` it is ignored: the old, equal weighting.

        Returns True when the optimizer step was applied (the window closed and the
        GradScaler did not skip it); False otherwise (``pending`` tells the two apart:
        it is 0 right after a boundary).
        """
        if not loss.requires_grad:  # torch's "element 0 of tensors does not require grad"
            raise UsageError(f"the loss {NO_GRADIENT}")
        if self._stale:  # the caller did not zero_grad(): the old step's must not add up
            self.zero_grad()
        # DDP all-reduces in this backward iff a forward armed it since the last one.
        reduced = self._armed or self._ddp is None
        self._armed = False
        if (reduced and self._steps == 1 and self._plain_step and self.clip_norm is None
                and self._window_samples is None):
            # One micro-batch per step, no scaler, clipping or early freeing: what a
            # hand-written loop does, without the bookkeeping calls (the training loop's
            # most common step).
            torch.autograd.backward(loss)
            self.optimizer.step()
            self._applied += 1
            self._stale = True
            return True
        if samples is not None and self._window_samples is not None:
            scaled = loss * (samples / self._window_samples)
            self._seen_samples += samples
        else:
            scaled = loss / self._steps if self._steps > 1 else loss
        if self._scaling is not None:
            self._scaling.backward(scaled)
        else:
            torch.autograd.backward(scaled)
        self._unsynced = not reduced
        self.pending += 1
        if self.pending < self._steps:
            return False
        if self._unsynced:
            self._sync_by_hand()
        return self._apply()

    def flush(self) -> bool:
        """Step on a partial window (e.g. the epoch's last micro-batches).

        Gradients are multiplied by ``steps / pending`` so the step uses the mean over
        the micro-batches actually seen, as one batch of that size would (with
        ``window_samples``: by ``window_samples`` over the samples seen, averaged over
        the ranks under DDP). Under DDP the gradients skipped by ``no_sync`` are
        all-reduced here. Returns True when a step was applied; False when nothing was
        pending or the GradScaler skipped it.
        """
        if self.pending == 0:
            return False
        seen = float(self._seen_samples)
        if self._unsynced and self._ddp is not None:
            group = self._ddp.process_group
            self._sync_by_hand()
            if self._window_samples is not None and dist.get_world_size(group) > 1:
                seen = self._mean_over_ranks(seen, group)
        if self._window_samples is not None:
            factor = self._window_samples / seen if seen > 0 else 1.0
        else:
            factor = self._steps / self.pending
        if factor != 1.0:
            with torch.no_grad():
                for param in self.model.parameters():
                    if param.grad is not None:
                        param.grad.mul_(factor)
        return self._apply()

    def _apply(self) -> bool:
        """Unscale, clip, step (or have the scaler skip), zero the gradients."""
        if self._scaling is not None:
            self._scaling.unscale_(self.optimizer)
        if self.clip_norm is not None:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.clip_norm
            )
        if self._scaling is not None:
            stepped = self._scaling.step(self.optimizer)
        else:
            self.optimizer.step()
            stepped = True
        if stepped:
            self._applied += 1
        else:
            self._skipped += 1
        if self._zero_after_step:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self._stale = True
        self.pending = 0
        self._seen_samples = 0
        self._unsynced = False
        return stepped

    def _sync_by_hand(self) -> None:
        """What DDP's synchronising backward does, for a window whose last backward was
        not one: average the gradients over the ranks, and have DDP broadcast its
        buffers (BatchNorm statistics) at the next forward."""
        ddp = self._ddp
        if ddp is None:
            return
        self._average_gradients(ddp.process_group)
        ddp.require_forward_param_sync = True

    def _mean_over_ranks(self, value: float, group: dist.ProcessGroup | None) -> float:
        params = [p for p in self.model.parameters()]
        device = params[0].device if params else torch.device("cpu")
        if dist.get_backend(group) == "gloo":
            device = torch.device("cpu")
        total = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(total, group=group)
        return float(total.item()) / dist.get_world_size(group)

    def _average_gradients(self, group: dist.ProcessGroup | None) -> None:
        """All-reduce-mean the local gradients by hand, as DDP would have.

        Averaging is linear, so gradients already averaged on an earlier synced
        micro-step stay correct. Parameters with no gradient on any rank stay None.
        """
        world = dist.get_world_size(group)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if world == 1 or not params:
            return
        device = params[0].device
        has_grad = torch.tensor(
            [p.grad is not None for p in params], dtype=torch.uint8, device=device
        )
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=group)
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for param, flag in zip(params, has_grad.tolist(), strict=True):
            if not flag:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            buckets.setdefault((param.grad.device, param.grad.dtype), []).append(param.grad)
        with torch.no_grad():
            for grads in buckets.values():
                flat = torch.cat([g.reshape(-1) for g in grads])
                dist.all_reduce(flat, group=group)
                flat.div_(world)
                offset = 0
                for grad in grads:
                    count = grad.numel()
                    grad.copy_(flat[offset : offset + count].view_as(grad))
                    offset += count
