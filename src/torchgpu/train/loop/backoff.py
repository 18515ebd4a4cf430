"""Out-of-memory back-off inside the training loop: same data, smaller pieces.

On ``torch.OutOfMemoryError`` in a forward or backward, :class:`LoopBackoff` halves the
micro-batch and replays the accumulation window from its first batch and random state,
each loader batch cut into pieces weighted by their rows. The effective batch, the data
order and the loop's step bookkeeping are unchanged: the result is what a run started at
the smaller batch with more accumulation computes. At micro-batch 1 it raises
:class:`~torchgpu.errors.OutOfMemoryBackoffError`; any other error propagates untouched.

Under DDP no collective is added to the normal step: a failing rank is *poisoned*, runs
stand-in forwards to the window's boundary and backpropagates NaN; the all-reduce carries
it, the finite guard stops the step on every rank, and only then do the ranks agree (one
small collective) to back off, or to treat it as a real non-finite loss. An OOM inside the
synchronising backward cannot be agreed on (the peers wait in the all-reduce): it raises.
"""

from __future__ import annotations

import json
import math
import sys
import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from torchgpu.data.batches import (
    batch_rows,
    first_rows,
    output_loss,
    split_rows,
    zero_loss_like,
)
from torchgpu.errors import OutOfMemoryBackoffError
from torchgpu.memory.oom import (
    FIX_HINT,
    Agree,
    OOMBackoff,
    is_oom,
    release_failed_step,
    release_memory,
)
from torchgpu.parallel.data import find_ddp
from torchgpu.train.loop.outcome import BatchOutcome
from torchgpu.train.loop.random_state import WindowRandomState

Batch = tuple[Tensor, Tensor]
LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class BackoffEvent:
    """One back-off, in the user's terms (accumulation = micro-steps per optimizer step)."""

    micro_batch: int
    accumulate: int
    previous_micro_batch: int
    previous_accumulate: int
    effective_batch: int
    reason: str

    def describe(self) -> str:
        return (f"out of memory at micro-batch {self.previous_micro_batch} "
                f"(x{self.previous_accumulate} accumulation): retrying the window at "
                f"micro-batch {self.micro_batch} x{self.accumulate} accumulation, "
                f"effective batch {self.effective_batch} unchanged")

    def as_dict(self) -> dict[str, Any]:
        return {"micro_batch": self.micro_batch, "accumulate": self.accumulate,
                "previous_micro_batch": self.previous_micro_batch,
                "previous_accumulate": self.previous_accumulate,
                "effective_batch": self.effective_batch, "reason": self.reason}


class LoopBackoff:
    """The loop's OOM back-off state for one run.

    ``batch_size``: the loader's batch (the starting micro-batch). ``accumulate``: loader
    batches per optimizer step. ``on_event`` is called once per back-off (every rank
    alike). ``agree`` overrides the min-over-ranks collective (tests).
    """

    def __init__(self, model: nn.Module, accumulator: Any, loss_fn: LossFn, *,
                 batch_size: int, accumulate: int = 1, autocast: Any = None,
                 device: torch.device | str | None = None, distributed: bool = False,
                 on_event: Callable[[BackoffEvent], None] | None = None,
                 agree: Agree | None = None) -> None:
        from torchgpu.train.loop.tail import EmptySafeLoss

        # An empty batch (a DDP rank's share of the epoch's last batch) gives a zero loss.
        self.model, self.acc, self.loss_fn = model, accumulator, EmptySafeLoss(loss_fn)
        self.batch_size = batch_size
        self.accumulate = accumulate
        self.micro_batch = batch_size
        self.poisoned: BaseException | None = None
        self.events: list[BackoffEvent] = []
        self._oom = OOMBackoff(
            batch_size, 1, device=device, agree=agree, outer_accumulate=accumulate
        )
        self._autocast: Callable[[], AbstractContextManager[Any]] = (
            autocast if autocast is not None else nullcontext)
        self._ddp = find_ddp(model) if distributed else None
        self._on_event = on_event
        # Set by the loop under DDP (FiniteGuard.poison): makes the watched gradient NaN.
        self.poison_loss: Callable[[Tensor], Tensor] | None = None
        #: The random state at the window's start (marked by the loop), for replays.
        self.random_state = WindowRandomState(device)

    @property
    def active(self) -> bool:
        """True once the loop must route batches here (backed off, or poisoned)."""
        return self.micro_batch < self.batch_size or self.poisoned is not None

    # -- entry points used by the loop ---------------------------------------------------

    def run_batch(self, x: Tensor, y: Tensor) -> BatchOutcome:
        """One loader batch in pieces of at most ``micro_batch`` (exceptions propagate
        to the loop, which calls :meth:`recover` or :meth:`after_nonfinite`)."""
        value, stepped = self._batch(x, y)
        return BatchOutcome(value, stepped)

    def recover(self, error: BaseException, window: list[Batch], in_backward: bool) -> BatchOutcome:
        """The loop's fast path raised ``error`` on ``window[-1]``. Re-raises anything but
        an out-of-memory error; one process: backs off and replays ``window``; DDP:
        poisons this rank (or raises when the failure was in a synchronising backward)."""
        if not is_oom(error):
            raise error
        if self._ddp is None:
            self._decide(error)
            return self.replay(window)
        boundary = self.acc.pending + 1 >= self.acc.steps
        if in_backward and boundary:
            raise self._unsafe(error) from error
        self._poison(error, in_forward=not in_backward)
        x = window[-1][0]
        try:
            with self.acc.micro_step():
                stepped = self._stand_in(x, last=True)
        except Exception as caught:
            from torchgpu.train.guards.agreement import NonFiniteGradients

            if not isinstance(caught, NonFiniteGradients):
                raise
            outcome = self.after_nonfinite(window)
            return outcome if outcome is not None else BatchOutcome(math.nan, False, dropped=True)
        return BatchOutcome(math.nan, stepped)

    def after_nonfinite(self, window: list[Batch]) -> BatchOutcome | None:
        """DDP, collective: the boundary's gradients were non-finite on every rank. Agree
        whether any rank ran out of memory; if so back off and replay ``window``, else
        return None (a real non-finite loss, for ``--on-nonfinite``)."""
        self.acc.reset()
        error, self.poisoned = self.poisoned, None
        decision = self._oom.check(error)
        if decision is None:
            return None
        self._apply(decision.micro_batch, decision.accumulate, decision.reason, error)
        return self.replay(window)

    def replay(self, window: list[Batch]) -> BatchOutcome:
        """Run ``window`` again from a zeroed window, backing off until it fits."""
        from torchgpu.train.guards.agreement import NonFiniteGradients

        while True:
            self.random_state.restore()  # the same dropout masks as the first try
            try:
                return self._run_window(window)
            except NonFiniteGradients:  # DDP boundary: poison or a real non-finite loss
                self.acc.reset()
                error, self.poisoned = self.poisoned, None
                decision = self._oom.check(error)
                if decision is None:
                    return BatchOutcome(math.nan, False, dropped=True)
                self._apply(decision.micro_batch, decision.accumulate, decision.reason, error)
            except Exception as error:
                if self._ddp is not None or not is_oom(error):
                    raise
                self._decide(error)

    # -- the work -------------------------------------------------------------------------

    def _run_window(self, window: list[Batch]) -> BatchOutcome:
        values: list[float] = []
        stepped = False
        for x, y in window:
            value, stepped = self._batch(x, y)
            if self._ddp is None and not math.isfinite(value):
                return BatchOutcome(math.nan, False)  # one process: the loop drops the window
            values.append(value)
        finite = [v for v in values if math.isfinite(v)]
        return BatchOutcome(values[-1], stepped, (math.fsum(finite), len(finite)))

    def _batch(self, x: Tensor, y: Tensor) -> tuple[float, bool]:
        """Forward/backward of one loader batch in pieces; the last piece goes through
        the accumulator (which steps at the window's boundary)."""
        n = batch_rows(x)
        count = max(1, -(-n // self.micro_batch))
        xs = split_rows(x, count)
        ys = xs if y is x else split_rows(y, count)  # a dict batch is its own target
        acc = self.acc
        total = 0.0
        stepped = False
        with acc.micro_step() as boundary:
            for index, (xi, yi) in enumerate(zip(xs, ys, strict=True)):
                last = index == count - 1
                if self.poisoned is not None:
                    stepped = self._stand_in(xi, last)
                    continue
                weight = batch_rows(xi) / n if n else 1.0
                in_forward = True
                try:
                    with self._no_sync(last):
                        with self._autocast():
                            loss = self.loss_fn(self.model(xi), yi)
                        value = loss.item()
                        if self._ddp is None and not math.isfinite(value):
                            return math.nan, False  # decided before backward, as the loop does
                        total += weight * value
                        in_forward = False
                        if self.poison_loss is not None and not math.isfinite(value):
                            loss = self.poison_loss(loss)  # DDP: the guard decides
                        if last:  # (the window's sample weighting, if any, by ``n``)
                            stepped = acc.backward(loss * weight if weight != 1.0 else loss, n)
                        elif acc.window_samples is None:
                            self._backward(loss * (weight / acc.steps))
                        else:
                            self._backward(loss * (weight * n / acc.window_samples))
                except Exception as error:
                    if self._ddp is None or not is_oom(error):
                        raise
                    loss = None  # drop the failed piece's graph now
                    if not in_forward and last and boundary:
                        raise self._unsafe(error) from error
                    self._poison(error, in_forward)
                    if last:
                        stepped = self._stand_in(xi, last=True)
        return (math.nan if self.poisoned is not None else total), stepped

    def _no_sync(self, last: bool) -> AbstractContextManager[Any]:
        # Pieces before a batch's last one never all-reduce; the last one follows the
        # accumulator's micro_step (synchronised only at the window's boundary).
        if self._ddp is None or last:
            return nullcontext()
        return self._ddp.no_sync()

    def _backward(self, loss: Tensor) -> None:
        precision = getattr(self.acc, "precision", None)
        if precision is not None:
            precision.backward(loss)
        else:
            torch.autograd.backward(loss)

    def _stand_in(self, x: Tensor, last: bool) -> bool:
        """A poisoned rank's stand-in for one piece: a forward on two samples (DDP's
        forward collectives line up), and on a batch's last piece a NaN loss through the
        accumulator, so the window's all-reduce carries the poison to every rank."""
        # In train mode this updates BatchNorm running statistics on this rank: the window
        # is replayed, so the weights are exact; those statistics are not.
        small = first_rows(x, 2)
        with self._no_sync(last):
            with self._autocast():
                out = self.model(small)
            if not last:
                return False
            connected = out.float().sum() if isinstance(out, Tensor) else zero_loss_like(out)
            if connected is None:  # an output with no batched tensor: its loss, if any
                connected = output_loss(out, small)
            loss = connected * math.nan
            if self.poison_loss is not None:
                loss = self.poison_loss(loss)
            stepped: bool = self.acc.backward(loss)
            return stepped

    # -- decisions ------------------------------------------------------------------------

    def _decide(self, error: BaseException) -> None:
        decision = self._oom.check(error)  # re-raises non-OOM; OutOfMemoryBackoffError at 1
        if decision is None:  # only a wrong ``agree`` says nobody failed after an OOM here
            raise error
        self._apply(decision.micro_batch, decision.accumulate, decision.reason, error)

    def _apply(self, micro: int, pieces: int, reason: str, error: BaseException | None) -> None:
        release_failed_step(self.model, getattr(self.acc, "optimizer", None), error)
        self.acc.reset()
        previous = self.micro_batch
        previous_pieces = max(1, -(-self.batch_size // previous))
        self.micro_batch = micro
        event = BackoffEvent(
            micro_batch=micro, accumulate=self.accumulate * pieces,
            previous_micro_batch=previous,
            previous_accumulate=self.accumulate * previous_pieces,
            effective_batch=self.batch_size * self.accumulate, reason=reason)
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    def _poison(self, error: BaseException, in_forward: bool) -> None:
        if in_forward and self._ddp is not None:
            # DDP's pre-forward (buffer broadcast) already ran for the failed forward; its
            # post-forward did not. The peers' post-forward of a no_sync forward cleared
            # this flag; a stand-in re-forward must not broadcast a second time.
            self._ddp.require_forward_param_sync = False
        if error.__traceback__ is not None:
            traceback.clear_frames(error.__traceback__)
        self.poisoned = error
        release_memory()

    def _unsafe(self, error: BaseException) -> OutOfMemoryBackoffError:
        micro = self.micro_batch
        pieces = max(1, -(-self.batch_size // micro))
        smaller = max(1, micro // 2)
        return OutOfMemoryBackoffError(
            f"out of memory in the gradient-synchronising backward at micro-batch {micro} "
            f"(x{self.accumulate * pieces} accumulation): under DDP the other ranks are "
            "already inside the all-reduce, so the ranks cannot agree on a smaller "
            f"micro-batch at this point. Restart with --batch-size {smaller} --accumulate "
            f"{self.accumulate * pieces * 2} (the same effective batch), or: {FIX_HINT}."
        )


def for_run(model: nn.Module, accumulator: Any, loss_fn: LossFn, precision: Any, *,
            batch_size: int, accumulate: int, device: torch.device, distributed: bool,
            out_dir: Path | None, position: Callable[[], tuple[int, int]]) -> LoopBackoff:
    """The back-off ``torchgpu train`` uses (for a strategy whose ``features.backoff`` is
    None: fsdp reduce-scatters inside every backward, model/pipeline cut batches
    themselves). Each back-off is printed and appended to ``metrics.jsonl`` as an
    ``oom_backoff`` line on rank 0 (``out_dir`` set); ``position()`` gives (optimizer
    steps, epoch)."""
    autocast = precision.autocast if getattr(precision, "dtype", None) is not None else None

    def log(event: BackoffEvent) -> None:
        if out_dir is None:
            return
        from torchgpu.train.outputs import files as outputs

        step, epoch = position()
        print(f"{event.describe()} (step {step + 1}, epoch {epoch + 1})", file=sys.stderr)
        line = {"kind": "oom_backoff", "step": step + 1, "epoch": epoch, **event.as_dict()}
        outputs.append_lines(out_dir / outputs.METRICS_FILE, [json.dumps(line)])

    return LoopBackoff(model, accumulator, loss_fn, batch_size=batch_size,
                       accumulate=accumulate, autocast=autocast, device=device,
                       distributed=distributed, on_event=log)
