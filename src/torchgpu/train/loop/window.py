"""One accumulation window's losses, the step it ends in, and ``--on-nonfinite``.

The loop hands :class:`WindowLosses` each micro-batch's loss (:meth:`~WindowLosses.add`;
None until the boundary on an accelerator, where the losses stay on the device) and closes
the window at each optimizer-step boundary (``WindowLosses.close``): the step's loss is
the mean of the window's finite micro-batch losses, appended to ``state.step_losses`` and
the step records, then the ``on_step`` hook runs. A window holding a non-finite loss never
reaches the weights: ``stop`` raises ``NonFiniteLossError``; ``skip`` drops the window,
takes it out of the epoch's sums and counts it as skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from torchgpu.errors import NonFiniteLossError
from torchgpu.train.loop.outcome import BatchOutcome
from torchgpu.train.state import TrainState

if TYPE_CHECKING:
    from torchgpu.train.loop.loss_reader import LossCopy, LossReader
    from torchgpu.train.loop.parts import Window

StepRecords = list[tuple[int, int, float]]

FIX = ("Lower --lr, add --clip-norm, check the data for NaN/inf, or pass "
       "--on-nonfinite skip to drop such steps.")


class WindowLosses:
    """The current window's loss sums for one epoch of the loop.

    ``distributed``: several ranks decide together (DDP's guard); a non-finite loss then
    waits for the boundary. ``on_nonfinite``: ``"stop"`` or ``"skip"``.
    """

    def __init__(self, state: TrainState, records: StepRecords, accumulator: Window, *,
                 on_step: Callable[[TrainState], None] | None, on_nonfinite: str,
                 rank: int, distributed: bool, reader: LossReader | None = None) -> None:
        self.state, self.records, self.acc = state, records, accumulator
        self.on_step = on_step
        self.on_nonfinite, self.rank, self.distributed = on_nonfinite, rank, distributed
        self.reader = reader
        self.sum = 0.0  # the window's finite losses, each times its logged factor
        self.count = 0
        self.bad = False  # DDP: a non-finite local loss in this window (for the message)
        self.factors: list[float] = []  # logged factors of losses still on the device
        self.last = math.nan  # the latest loss known on the host (for the progress line)
        # Late reads (LossReader.late): the last step's window, until settle() reads it.
        self._held: tuple[LossCopy, list[float]] | None = None

    def add(self, value: float | None, bad: bool, logged: float,
            outcome: BatchOutcome | None) -> None:
        """One micro-batch's loss (``logged``: its factor in the logged means; ``value``
        None: still on the device, read at the window's boundary)."""
        state = self.state
        if value is None and outcome is None:
            self.factors.append(logged)
            return
        if outcome is not None and outcome.dropped:
            self.drop(self.bad or bad)
            return
        if outcome is not None:  # the back-off took the window over and read its losses
            self.factors.clear()
        if value is None:
            pass
        elif bad:
            if not self.distributed:  # one process: decided on the loss, before backward
                self._nonfinite_loss(value)
                self.sum, self.count = 0.0, 0
            else:
                self.bad = True  # kept out of the sums; the boundary decides
        else:
            self.last = value
            state.epoch_loss_sum += value * logged
            state.epoch_loss_count += 1
            self.sum += value * logged
            self.count += 1
        if outcome is not None and outcome.window is not None:
            # The window was replayed after a back-off: its losses were recomputed.
            total, count = outcome.window
            state.epoch_loss_sum += total - self.sum
            state.epoch_loss_count += count - self.count
            self.sum, self.count = total, count

    def close(self, stepped: bool, *, hold: bool = False) -> None:
        """At an optimizer-step boundary (stepped, skipped by the GradScaler or dropped):
        record the step when the optimizer stepped, then start a new window.

        ``hold`` (late reads: the reader copied the window's losses in the step's
        pre-hook): keep the window, unread, until :meth:`settle` (the next step's
        pre-hook, or the loop before it returns) records it."""
        if self._held is not None:
            self.settle()
        reader = self.reader
        if hold and stepped and self.factors and reader is not None:
            copy = reader.copied()
            if copy is not None:
                self._held, self.factors = (copy, self.factors), []
                return
        if self.factors and not self._fold(*self._read_window()):
            return  # a non-finite loss the step's check did not see (a skipped step)
        if stepped:
            self._record()
        self.sum, self.count, self.bad = 0.0, 0, False

    def settle(self) -> None:
        """Late reads: the window held since the last step, read (its copy is done by
        now), folded into the sums and recorded with its ``on_step``, or its non-finite
        loss acted on (``stop`` raises: the step was skipped on the device, the next one
        has not run). Nothing when no window is held."""
        held, self._held = self._held, None
        if held is None:
            return
        copy, factors = held
        # The window in progress has no losses on the host yet (one micro-batch a step).
        progress = self.sum, self.count, self.bad
        self.sum, self.count, self.bad = 0.0, 0, False
        try:
            folded = self._fold(copy.values(), factors)
        except NonFiniteLossError:
            self.acc.reset()  # the next step's gradients, computed already, go too
            raise
        if folded:
            self._record()
        self.sum, self.count, self.bad = progress

    def _read_window(self) -> tuple[list[float], list[float]]:
        """The window's losses (read off the device) and their logged factors; the
        window starts anew."""
        assert self.reader is not None  # factors are kept only with a reader
        factors, self.factors = self.factors, []
        return self.reader.take(), factors

    def _record(self) -> None:
        state = self.state
        state.step += 1
        mean = self.sum / self.count if self.count else math.nan
        state.step_losses.append(mean)
        self.records.append((state.step, state.epoch, mean))
        if self.on_step is not None:
            self.on_step(state)

    def drop(self, local: bool) -> None:
        """DDP: the window's all-reduced gradients are non-finite on every rank (checked
        before the optimizer step). ``stop`` raises on every rank; ``skip`` takes the
        window's losses out of the epoch's sums and counts the skipped step."""
        state = self.state
        reader = self.reader
        if reader is not None and reader.pending:  # read them for the message, then forget
            values = reader.take()
            self.factors.clear()
            local = local or not all(math.isfinite(v) for v in values)
            if not self.distributed:
                self.sum, self.count = 0.0, 0
                self._nonfinite_loss(next((v for v in values if not math.isfinite(v)),
                                          math.nan))
                self.bad = False
                return
        if self.on_nonfinite == "stop":
            seen = (f"a non-finite loss on rank {self.rank}" if local else
                    f"non-finite gradients after the all-reduce (a non-finite loss on "
                    f"another rank; this is rank {self.rank})")
            raise NonFiniteLossError(
                f"{seen} {self._where()}: training stopped on every rank before the update "
                f"reached the weights. {FIX}")
        self.acc.reset()
        state.epoch_loss_sum -= self.sum
        state.epoch_loss_count -= self.count
        state.skipped_steps += 1
        self.sum, self.count, self.bad = 0.0, 0, False

    def _fold(self, values: list[float], factors: list[float]) -> bool:
        """The window's losses read off the device (``values``: one sync unless the
        step's pre-hook read them; ``factors``: each one's logged factor) into the sums.
        False when one process found a non-finite loss there (``--on-nonfinite``
        applied: the window is gone)."""
        state = self.state
        for value, logged in zip(values, factors, strict=False):
            if not math.isfinite(value):
                if not self.distributed:
                    self._nonfinite_loss(value)
                    self.sum, self.count = 0.0, 0
                    return False
                self.bad = True
                continue
            state.epoch_loss_sum += value * logged
            state.epoch_loss_count += 1
            self.sum += value * logged
            self.count += 1
            self.last = value
        return True

    def _nonfinite_loss(self, value: float) -> None:
        if self.on_nonfinite == "stop":
            raise NonFiniteLossError(
                f"loss {value} on rank {self.rank} {self._where()}: training stopped before "
                f"the update reached the weights. {FIX}")
        # skip: drop the whole accumulation window (its gradients are partial) and count it;
        # its earlier finite losses leave the epoch's sums too, as under DDP (drop()).
        self.acc.reset()
        self.state.epoch_loss_sum -= self.sum
        self.state.epoch_loss_count -= self.count
        self.state.skipped_steps += 1

    def _where(self) -> str:
        state = self.state
        return (f"at step {state.step + 1} (epoch {state.epoch + 1}, batch "
                f"{state.batch_in_epoch})")
