"""One micro-batch through the model, and the two things that may take it over.

:class:`MicroStep` is what the loop (:func:`torchgpu.train.loop.epoch.run_epoch`) calls per
micro-batch: forward and loss under autocast (inside the accumulator's ``micro_step``
when a window holds several micro-batches), the loss read once (``.item()``), then
backward through the accumulator, which steps the optimizer at the window's boundary.
A non-finite loss gets no backward in one process (the loop decides); under DDP it is
backpropagated poisoned (:meth:`~torchgpu.train.guards.agreement.FiniteGuard.poison`) so the
all-reduce carries the decision to every rank.

What may take a micro-batch over, both decided here so the loop stays one path:

- **OOM back-off** (``parts.backoff``, :class:`torchgpu.train.loop.backoff.LoopBackoff`): an
  out-of-memory error in forward or backward is handed to the back-off with the window's
  batches (held until the boundary), which halves the micro-batch and replays the window
  from the random state kept at the window's start (same dropout masks); once backed
  off, batches run through the back-off's pieces.
- **DDP's finite guard** (:class:`~torchgpu.train.guards.agreement.FiniteGuard`): non-finite
  all-reduced gradients at a boundary end the window (dropped), or, with back-off armed,
  first ask every rank whether one ran out of memory (then the window is replayed).

Each call of :attr:`MicroStep.run` returns ``(value, bad, stepped, outcome)``: the
loss, whether it was non-finite here, whether the optimizer stepped, and the back-off's
or guard's :class:`~torchgpu.train.loop.outcome.BatchOutcome` when one took over (None
otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from torch import Tensor

from torchgpu.memory.oom import is_oom
from torchgpu.train.guards.agreement import FiniteGuard, NonFiniteGradients
from torchgpu.train.loop.outcome import BatchOutcome

if TYPE_CHECKING:
    from torchgpu.train.loop.parts import LoopParts

LossFn = Callable[[Any, Any], Tensor]
Result = tuple[float, bool, bool, "BatchOutcome | None"]

DROPPED = BatchOutcome(math.nan, False, dropped=True)


class MicroStep:
    """Runs micro-batches for one epoch of the loop (see the module docstring).

    Everything that does not change per step (contexts to enter, whether a guard or a
    back-off watches) is decided here, once: a plain fp32 run without back-off calls
    :meth:`compute` directly.
    """

    def __init__(self, parts: LoopParts, guard: FiniteGuard | None) -> None:
        self.model, self.acc, self.guard = parts.model, parts.accumulator, guard
        # fp32 and 1-micro-batch windows need no context: nullcontext is ~5x cheaper than
        # a generator-based one, and this runs every step.
        precision = parts.precision
        self._autocast = (precision.autocast if getattr(precision, "dtype", True) is not None
                          else nullcontext)
        self._micro = self.acc.micro_step if parts.accumulate > 1 else nullcontext
        self._plain = self._autocast is nullcontext and self._micro is nullcontext
        backoff = self.backoff = parts.backoff
        if backoff is not None and guard is not None:
            backoff.poison_loss = guard.poison
        # The window's batches, held until the next window starts so a back-off can replay
        # it; a window of one batch is the current one (no list to fill and clear every step).
        self.held: list[tuple[Any, Any]] | None = (
            [] if backoff is not None and parts.accumulate > 1 else None)
        self._routed = backoff is not None and backoff.active  # changes only in back-off
        # The random state a replay starts from, kept at each window's start.
        self._random = backoff.random_state if backoff is not None else None
        self._value: float | None = None  # this micro-batch's loss, once read
        #: ``run(x, y, n, loss_fn)``: one micro-batch of ``n`` samples.
        self.run: Callable[[Any, Any, int, LossFn], Result] = (
            self._watched if backoff is not None or guard is not None else self._direct)

    def compute(self, x: Any, y: Any, n: int, loss_fn: LossFn) -> tuple[float, bool]:
        """Forward, loss, backward: ``(loss value, stepped)``."""
        acc = self.acc
        if self._plain:
            loss = loss_fn(self.model(x), y)
            value = self._value = loss.item()
            if math.isfinite(value):
                return value, acc.backward(loss, n)
            return value, self._backward_bad(loss)
        with self._micro():
            with self._autocast():
                loss = loss_fn(self.model(x), y)
            value = self._value = loss.item()
            if math.isfinite(value):
                return value, acc.backward(loss, n)
            return value, self._backward_bad(loss)

    def _direct(self, x: Any, y: Any, n: int, loss_fn: LossFn) -> Result:
        value, stepped = self.compute(x, y, n, loss_fn)
        return value, not math.isfinite(value), stepped, None

    def _backward_bad(self, loss: Tensor) -> bool:
        """A non-finite loss. One process decides on it before backward (no backward).
        Under DDP every rank must run backward (the all-reduce needs all): with the
        guard's poison, so the guard stops the step on every rank at the boundary."""
        if self.guard is None:
            return False
        return self.acc.backward(self.guard.poison(loss))

    def _watched(self, x: Any, y: Any, n: int, loss_fn: LossFn) -> Result:
        """:meth:`compute` with the back-off and the guard watching."""
        backoff, held = self.backoff, self.held
        if self.acc.pending == 0:  # a window starts: the last one's batches are done
            if held is not None:
                held.clear()
            random = self._random
            if random is not None and random.armed:
                random.mark()
        if held is not None:
            held.append((x, y))
        self._value = None
        loss: Tensor | None = None
        try:
            if not self._routed:
                if self._plain:  # compute(), inlined: this runs every step
                    loss = loss_fn(self.model(x), y)
                    value = self._value = loss.item()
                    stepped = (self.acc.backward(loss, n) if math.isfinite(value)
                               else self._backward_bad(loss))
                else:
                    value, stepped = self.compute(x, y, n, loss_fn)
                if stepped or self.acc.pending or backoff is None or self.guard is None:
                    return value, not math.isfinite(value), stepped, None
                return self._settle(value, False, None, x, y)  # a step the scaler skipped
            # backed off (or poisoned): the pieces run in the back-off
            assert backoff is not None  # routed only through an armed back-off
            outcome = backoff.run_batch(x, y)
        except NonFiniteGradients:  # DDP: the boundary's all-reduced grads are not finite
            self.acc.reset()
            outcome = (backoff.after_nonfinite(self._window(x, y)) if backoff is not None
                       else None) or DROPPED
        except Exception as error:
            if backoff is None or not is_oom(error):
                raise
            loss = None  # the failed try's graph (and its activations): freed before the replay
            # the loss was read: the failure was in backward
            outcome = backoff.recover(error, self._window(x, y), self._value is not None)
        return self._settle(math.nan, False, outcome, x, y)

    def _window(self, x: Any, y: Any) -> list[tuple[Any, Any]]:
        return self.held or [(x, y)]

    def _settle(self, value: float, stepped: bool, outcome: BatchOutcome | None, x: Any,
                y: Any) -> Result:
        """The result once the back-off or the guard took over (``outcome``), or after a
        step skipped by the GradScaler under DDP with back-off armed."""
        local = self._value  # the loss this rank computed, if it got that far
        bad = local is not None and not math.isfinite(local)
        if outcome is not None:
            self._routed = self.backoff is not None and self.backoff.active
            stepped = outcome.stepped
            if not outcome.dropped:
                value = outcome.value
                bad = not math.isfinite(value)
            elif local is not None:
                value = local
        backoff = self.backoff
        if (not stepped and self.guard is not None and backoff is not None
                and self.acc.pending == 0 and (outcome is None or not outcome.dropped)):
            # A skipped step the guard did not see (the fp16 GradScaler's): another rank's
            # out-of-memory poison looks the same, so agree (collective).
            again = backoff.after_nonfinite(self._window(x, y))
            self._routed = backoff.active
            if again is not None:
                outcome, stepped = again, again.stepped
        return value, bad, stepped, outcome
