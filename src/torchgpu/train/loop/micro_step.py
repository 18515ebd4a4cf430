"""One micro-batch through the model: forward and loss under autocast, then backward through
the accumulator, which steps the optimizer at the window's boundary.

Under DDP a non-finite loss is backpropagated poisoned, so the all-reduce carries the
decision to every rank and the finite guard stops the step on all of them. The OOM back-off
(``parts.backoff``) or a boundary with non-finite gradients may take a micro-batch over.
:meth:`MicroStep.run` returns ``(value, bad, stepped, outcome)``: the loss (None while it is
still on the device), whether it was non-finite, whether the optimizer stepped, and the
back-off's or the guard's ``BatchOutcome`` when one took over (None otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

from torch import Tensor

from torchgpu.memory.oom import is_oom
from torchgpu.train.guards.agreement import FiniteGuard, NonFiniteGradients
from torchgpu.train.loop.outcome import BatchOutcome
from torchgpu.train.loop.parts import Accumulator, StepResult

if TYPE_CHECKING:
    from torchgpu.train.loop.loss_reader import LossReader
    from torchgpu.train.loop.parts import LoopParts

LossFn = Callable[[Any, Any], Tensor]
Result = StepResult

DROPPED = BatchOutcome(math.nan, False, dropped=True)


class MicroStep:
    """Runs micro-batches for one epoch of the loop (see the module docstring).

    What does not change per step (the contexts to enter, whether a guard, a back-off or
    the loss reader watches) is decided here, once.
    """

    def __init__(self, parts: LoopParts, guard: FiniteGuard | None,
                 reader: LossReader | None = None) -> None:
        acc = parts.accumulator
        if not isinstance(acc, Accumulator):
            raise TypeError(f"the loop's accumulator {type(acc).__name__} runs no backward: "
                            "give LoopParts a GradAccumulator, or the strategy's own step")
        self.model, self.acc, self.guard, self.reader = parts.model, acc, guard, reader
        autocast = (parts.precision.autocast
                    if getattr(parts.precision, "dtype", True) is not None else None)
        micro = self.acc.micro_step if parts.accumulate > 1 else None
        # One context per micro-batch: the window's (DDP's no_sync) around autocast, or
        # either alone, or none (None: no `with` at all; even a nullcontext's three Python
        # calls cost ~0.6 % of the tiny MLP's step on the CPU, bench overhead).
        self._context: Callable[[], AbstractContextManager[Any]] | None = None
        if autocast is not None and micro is not None:
            self._context = _both(micro, autocast)
        elif autocast is not None:
            self._context = autocast
        elif micro is not None:
            self._context = micro
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
        self._forwarded = False  # this micro-batch's forward ended (a failure is in backward)

    def run(self, x: Any, y: Any, n: int, loss_fn: LossFn) -> Result:
        """One micro-batch of ``n`` samples: forward, loss, backward (the accumulator
        steps at the window's boundary), with the back-off, the guard and the reader
        watching."""
        backoff, held, acc = self.backoff, self.held, self.acc
        if acc.pending == 0 and backoff is not None:  # a window starts: the last one is done
            if held is not None:
                held.clear()
            random = self._random
            if random is not None and random.armed:
                random.mark()
        if held is not None:
            held.append((x, y))
        self._value, self._forwarded = None, False
        try:
            if not self._routed:
                context = self._context
                if context is None:
                    value, bad, stepped = self._forward_backward(x, y, n, loss_fn)
                else:
                    with context():
                        value, bad, stepped = self._forward_backward(x, y, n, loss_fn)
                if stepped or acc.pending or backoff is None or self.guard is None:
                    return value, bad, stepped, None
                return self._settle(value, False, None, x, y)  # a step the scaler skipped
            # backed off (or poisoned): the pieces run in the back-off
            assert backoff is not None  # routed only through an armed back-off
            outcome = backoff.run_batch(x, y)
        except NonFiniteGradients:  # the boundary's losses or gradients are not finite
            acc.reset()
            outcome = (backoff.after_nonfinite(self._window(x, y))
                       if backoff is not None and self.guard is not None else None) or DROPPED
        except Exception as error:
            if backoff is None or not is_oom(error):
                raise
            if self.reader is not None:
                if self.reader.before_step is not None:  # late reads: the last step first,
                    self.reader.before_step()  # so the back-off logs and replays after it
                self.reader.clear()  # the back-off replays the window and reads it itself
            outcome = backoff.recover(error, self._window(x, y), self._forwarded)
        if self.reader is not None and not outcome.dropped:
            self.reader.clear()  # replayed: the back-off read the window's losses itself
        return self._settle(None, False, outcome, x, y)

    def _forward_backward(self, x: Any, y: Any, n: int,
                          loss_fn: LossFn) -> tuple[float | None, bool, bool]:
        """Forward, loss and backward of one micro-batch (inside the step's context):
        ``(value, bad, stepped)`` as :meth:`run` returns them. The loss lives in this
        frame only: after an out-of-memory error the back-off clears the traceback's
        finished frames (``release_failed_step``), so the failed try's graph is freed
        before the replay."""
        acc = self.acc
        loss = loss_fn(self.model(x), y)
        self._forwarded = True
        if self.reader is not None:  # on the device until the step's pre-hook
            self.reader.add(loss)
            if self.guard is not None:
                loss = self.guard.poison_if_nonfinite(loss)
            return None, False, acc.backward(loss, n)
        value = self._value = loss.item()
        if math.isfinite(value):
            return value, False, acc.backward(loss, n)
        if self.guard is None:  # one process: no backward for it
            return value, True, False
        # DDP: every rank runs backward, this one poisoned
        return value, True, acc.backward(self.guard.poison(loss))

    def _window(self, x: Any, y: Any) -> list[tuple[Any, Any]]:
        return self.held or [(x, y)]

    def _settle(self, value: float | None, stepped: bool, outcome: BatchOutcome | None,
                x: Any, y: Any) -> Result:
        """The result once the back-off or the guard took over (``outcome``), or after a
        step skipped by the GradScaler under DDP with back-off armed."""
        local = self._value  # the loss this rank read, if it got that far
        bad = local is not None and not math.isfinite(local)
        if outcome is not None:
            self._routed = self.backoff is not None and self.backoff.active
            stepped = outcome.stepped
            if not outcome.dropped:
                value = outcome.value
                bad = not math.isfinite(value)
            else:
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
                if self.reader is not None and not again.dropped:
                    self.reader.clear()
        return value, bad, stepped, outcome


def _both(outer: Callable[[], AbstractContextManager[Any]],
          inner: Callable[[], AbstractContextManager[Any]]) -> Callable[[],
                                                                    AbstractContextManager[Any]]:
    @contextmanager
    def both() -> Iterator[None]:
        with outer(), inner():
            yield

    return both
