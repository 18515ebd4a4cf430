"""The training loop: plain functions over small pieces, no god object.

Per micro-batch: transfer (off-CPU only), autocast forward + loss, the non-finite
check, backward through the :class:`~torchgpu.accumulate.GradAccumulator` (which
steps at window boundaries). Per epoch the caller evaluates on the held-out split
(:func:`torchgpu.train.evaluation.evaluate`).

Hot path rules (the loop must stay within 2% of a hand-written loop): every decision
that does not change per step (transfer or not, distributed or not, progress or not)
is made before the loop; per step there is no I/O, no import, no capability probe.
The loss is read with one ``.item()`` per micro-batch (a host sync on GPU) because
the value feeds both the loss history and the non-finite check.

Checkpoint/resume hooks: ``on_step(state)`` runs after every optimizer step (a step
boundary, where a save is consistent); the stop flag is checked right after it, through
:func:`should_stop`. The data order of epoch ``e`` is a function of ``(seed, e)``
(:func:`start_epoch`), so a resumed run recreates it and skips ``state.batch_in_epoch``
micro-batches.

DDP (``parts.agree``) adds no collective to the step (see
:mod:`torchgpu.train.agreement`): the non-finite decision is taken from the already
all-reduced gradients (a step pre-hook on the optimizer, at each window's boundary), and
the ranks agree on the stop flag and the global mean losses every ~0.5 s
(:class:`~torchgpu.train.agreement.RankAgreement`) and at the epoch end. Between
agreements, ``state.step_losses``/``records``/``state.epoch_loss_sum`` hold this rank's
own values. Code that runs on every rank at the same boundary and needs the global
values or a stop decided right there (a checkpoint save, a step limit set in
``on_step``) calls :func:`sync_now` -- a collective, so every rank must call it.

Out of memory: with ``parts.backoff`` (:class:`torchgpu.train.backoff.LoopBackoff`) an
OOM in forward or backward halves the micro-batch and replays the accumulation window
(the window's batches are held until its boundary); without it the error propagates.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor, nn

from torchgpu.data.batches import batch_rows
from torchgpu.errors import NonFiniteLossError
from torchgpu.memory.oom import is_oom
from torchgpu.train.agreement import FiniteGuard, NonFiniteGradients, RankAgreement
from torchgpu.train.backoff import BatchOutcome
from torchgpu.train.state import StopFlag, TrainState
from torchgpu.train.tail import TailWindows
from torchgpu.transfer import to_device

if TYPE_CHECKING:
    from torchgpu.data.shards import ShardLayout
    from torchgpu.train.backoff import LoopBackoff

UI_INTERVAL_S = 0.1  # progress refresh period; the loop reads the clock, not the UI


class Accumulator(Protocol):
    """What the loop needs from :class:`torchgpu.accumulate.GradAccumulator`."""

    @property
    def steps(self) -> int: ...

    def micro_step(self) -> AbstractContextManager[Any]: ...

    def backward(self, loss: Tensor, samples: int | None = None) -> bool: ...

    def set_steps(self, steps: int, window_samples: float | None = None) -> None: ...

    @property
    def window_samples(self) -> float | None: ...

    def reset(self) -> None: ...

    def zero_grad(self) -> None: ...

    def flush(self) -> bool: ...

    @property
    def pending(self) -> int: ...


class Autocaster(Protocol):
    """What the loop needs from :class:`torchgpu.precision.Precision`."""

    def autocast(self) -> AbstractContextManager[Any]: ...


class ProgressSink(Protocol):
    """What the loop reports to (see :mod:`torchgpu.train.progress`); called ≤ 10 Hz."""

    def update(self, state: TrainState, loss: float, samples_per_s: float) -> None: ...


LossFn = Callable[[Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class LoopParts:
    """The pieces one micro-step uses. ``agree`` = several ranks decide together."""

    model: nn.Module
    loss_fn: LossFn
    accumulator: Accumulator
    precision: Autocaster
    device: torch.device
    accumulate: int = 1  # micro-batches per optimizer step (the configured window)
    move_batches: bool = False  # copy each batch to ``device`` (False: already there)
    on_nonfinite: str = "stop"  # "stop" | "skip"
    rank: int = 0
    agree: bool = False
    # Labels' device when the output is not on ``device`` (model/pipeline: the last
    # stage's device, ``model.output_device``); None = leave labels where they are.
    target_device: torch.device | None = None
    # OOM back-off (None: an out-of-memory error propagates). See torchgpu.train.backoff.
    backoff: LoopBackoff | None = None
    # DDP agreement on stop/losses, kept across epochs (its adaptive period) and reached
    # by on_step hooks through sync_now(parts); made here under ``agree`` when None.
    agreement: RankAgreement | None = None
    # How the epoch's samples fall on the ranks (torchgpu.data.shards): from the first
    # window holding a short micro-batch on, micro-batches are weighted by their samples
    # (torchgpu.train.tail). None: equal weights (exact when all batches are full).
    layout: ShardLayout | None = None

    def __post_init__(self) -> None:
        if self.agree and self.agreement is None:
            import torch.distributed as dist  # only under DDP: the group exists

            object.__setattr__(self, "agreement", RankAgreement(dist.get_world_size()))


@dataclass(frozen=True)
class EpochTotals:
    """What one call of :func:`run_epoch` did (this process only)."""

    micro_batches: int
    samples: int
    seconds: float
    # Stopped at a step boundary because the stop flag was set (under DDP: agreed), the
    # epoch's last boundary included: the caller saves and ends the run, no evaluation.
    stopped: bool


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffling seed of ``epoch``: a fixed function of (seed, epoch)."""
    return (seed * 1_000_003 + epoch * 7919 + 12345) % (2**63 - 1)


def start_epoch(loader: Iterable[Any], seed: int, epoch: int, skip: int = 0) -> Iterator[Any]:
    """Iterate ``loader`` in epoch ``epoch``'s order, skipping the first ``skip`` batches.

    Re-seeds the loader's generator with :func:`epoch_seed` and calls the sampler's
    (DistributedSampler) or batch sampler's (ShardBatches) ``set_epoch``, so the order
    depends only on (seed, epoch) — never on how many epochs this process has run.
    Skipped batches are still loaded (the order must be consumed exactly), then dropped.
    """
    for name in ("sampler", "batch_sampler"):  # DistributedSampler; ShardBatches
        sampler = getattr(loader, name, None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator):
        generator.manual_seed(epoch_seed(seed, epoch))
    iterator = iter(loader)
    if skip:
        return itertools.islice(iterator, skip, None)
    return iterator


_DROPPED = BatchOutcome(math.nan, False, dropped=True)


def should_stop(stop: StopFlag | None, agreement: RankAgreement | None) -> bool:
    """At an optimizer-step boundary: stop here? The same answer on every rank.

    One process: whether ``stop`` is set. DDP: the agreement's answer -- a collective
    only when one is due (about every 0.5 s, see :class:`RankAgreement`), so a stop flag
    set on any rank is honoured on all ranks at the same boundary, shortly after.
    """
    if agreement is None:
        return stop is not None and stop.is_set()
    return agreement.boundary()


def sync_now(parts: LoopParts) -> bool:
    """Agree now, at this step boundary, from code running inside :func:`run_epoch`
    (``on_step``) on every rank alike: the pending loss values become the global means
    (``state.step_losses``, the step records, ``state.epoch_loss_sum``) and the ranks
    agree on the stop flag; the loop then stops at this boundary if they did. Collective
    under DDP (every rank must call it at the same boundary, e.g. before a checkpoint
    save or after setting the stop flag for a step limit). Returns True when the ranks
    agreed to stop; False, and no work, in one process (``parts.agreement`` is None).
    """
    return parts.agreement.agree() if parts.agreement is not None else False


def run_epoch(
    parts: LoopParts,
    batches: Iterable[tuple[Tensor, Tensor]],
    state: TrainState,
    *,
    batches_per_epoch: int,
    stop: StopFlag | None = None,
    on_step: Callable[[TrainState], None] | None = None,
    progress: ProgressSink | None = None,
    records: list[tuple[int, int, float]] | None = None,
) -> EpochTotals:
    """Train over ``batches`` (the rest of epoch ``state.epoch``), advancing ``state``.

    ``batches_per_epoch`` is the epoch's full length: the last window is shortened to
    the remaining micro-batches (``set_steps``), so a final partial window is a real,
    synchronised boundary under DDP and its gradient is the mean over that window
    (with ``parts.layout``, over its samples: a window holding a short micro-batch, or
    a DDP rank's short or empty share of the last batch, weights each micro-batch by
    its samples, see :mod:`torchgpu.train.tail`).
    ``records`` receives ``(step, epoch, loss)`` per optimizer step (in memory).
    Returns at the epoch end, or at the first step boundary where :func:`should_stop`;
    ``stopped`` is True when the stop flag ended it (also when the stop was agreed at the
    epoch's end, after its last step).
    Non-finite loss: one process raises :class:`NonFiniteLossError`
    (on_nonfinite="stop") before that loss's gradients are computed; under DDP every
    rank raises (or skips) at the window's boundary, before the optimizer step, from
    the all-reduced gradients. Either way the weights never see it.
    """
    model, loss_fn, acc = parts.model, parts.loss_fn, parts.accumulator
    # fp32 and 1-micro-batch windows need no context: nullcontext is ~5x cheaper than a
    # generator-based one, and this runs every step.
    autocast = (parts.precision.autocast if getattr(parts.precision, "dtype", True) is not None
                else nullcontext)
    micro_step = acc.micro_step if parts.accumulate > 1 else nullcontext
    plain = autocast is nullcontext and micro_step is nullcontext
    device = parts.device
    move = parts.move_batches
    target_device = parts.target_device
    window = parts.accumulate
    tail = TailWindows(parts.layout, window, batches_per_epoch, loss_fn)
    tail_from = tail.start  # sys.maxsize without a layout or a short batch
    logged = 1.0  # the factor of this batch's loss in the logged means (tail: its share)
    if records is None:
        records = []
    backoff = parts.backoff
    # The window's batches, held until its boundary so an OOM back-off can replay it. A
    # window of one batch is the current (x, y): no list to fill and clear every step.
    held: list[tuple[Tensor, Tensor]] | None = (
        [] if backoff is not None and window > 1 else None)
    agreement: RankAgreement | None = None
    guard: FiniteGuard | None = None
    if parts.agree:
        agreement = parts.agreement
        assert agreement is not None  # LoopParts makes one under agree
        agreement.begin(state, records, stop)
        guard = FiniteGuard(acc)
        if backoff is not None:
            backoff.poison_loss = guard.poison
    window_sum = 0.0
    window_count = 0
    window_bad = False  # DDP: a non-finite local loss in this window (for the message)
    routed = backoff is not None and backoff.active  # changes only inside back-off calls
    micro = 0
    samples = 0
    if not model.training:  # model.train() walks every module (15 us on the housing net)
        model.train()
    started = time.perf_counter()
    next_ui = started + UI_INTERVAL_S
    try:
        for x, y in batches:
            n = x.shape[0] if isinstance(x, Tensor) else batch_rows(x)
            if state.batch_in_epoch >= tail_from:  # windows holding a short micro-batch
                loss_fn = tail.loss_fn  # an empty batch (a DDP rank's share) gives zero
                logged = tail.batch(acc, state.batch_in_epoch, n)
            elif window > 1 and acc.pending == 0:
                # At a boundary: the epoch's last window is as long as what is left of it.
                left = batches_per_epoch - state.batch_in_epoch
                wanted = left if 0 < left < window else window
                if acc.steps != wanted:
                    acc.set_steps(wanted)
            if move:
                same = y is x  # a dict batch is its own target
                x = to_device(x, device, non_blocking=True)
                y = x if same else to_device(y, device, non_blocking=True)
            if target_device is not None:
                y = to_device(y, target_device, non_blocking=True)
            if acc.pending == 0:  # a window starts: free the last step's gradients now,
                acc.zero_grad()   # before the forward, as a hand-written loop does
            replaced: BatchOutcome | None = None
            loss = None
            bad = False
            try:
                if held is not None:
                    held.append((x, y))
                if routed:  # backed off (or poisoned): the pieces run in the back-off
                    replaced = backoff.run_batch(x, y)  # type: ignore[union-attr]
                if replaced is None and plain:  # no context to enter (fp32, no window)
                    loss = loss_fn(model(x), y)
                    value = loss.item()
                    bad = not math.isfinite(value)
                    stepped = _backward_bad(acc, guard, loss) if bad else acc.backward(loss, n)
                elif replaced is None:
                    with micro_step():
                        with autocast():
                            loss = loss_fn(model(x), y)
                        value = loss.item()
                        bad = not math.isfinite(value)
                        stepped = _backward_bad(acc, guard, loss) if bad else acc.backward(loss, n)
            except NonFiniteGradients:  # DDP: the boundary's all-reduced grads are not finite
                acc.reset()
                if loss is None:  # raised inside the back-off's pieces: no local value here
                    value = math.nan
                replaced = (backoff.after_nonfinite(held or [(x, y)]) if backoff is not None
                            else None) or _DROPPED
            except Exception as error:
                if backoff is None or not is_oom(error):
                    raise
                in_backward = loss is not None
                loss = None  # the failed step's graph: free it before retrying
                replaced = backoff.recover(error, held or [(x, y)], in_backward)
            if replaced is not None:
                routed = backoff is not None and backoff.active
                stepped = replaced.stepped
                if not replaced.dropped:
                    value = replaced.value
                    bad = not math.isfinite(value)
            if (not stepped and guard is not None and backoff is not None
                    and acc.pending == 0 and (replaced is None or not replaced.dropped)):
                # A skipped step the guard did not see (the fp16 GradScaler's): another
                # rank's out-of-memory poison looks the same, so agree (collective).
                again = backoff.after_nonfinite(held or [(x, y)])
                routed = backoff.active
                if again is not None:
                    replaced, stepped = again, again.stepped
            state.batch_in_epoch += 1
            state.samples += n
            micro += 1
            samples += n
            if replaced is not None and replaced.dropped:
                _drop_window(parts, state, window_bad or bad, window_sum, window_count)
                window_sum, window_count, window_bad = 0.0, 0, False
            elif bad:
                if guard is None:  # one process: decided on the loss, before backward
                    _handle_nonfinite(parts, state, value, True)
                    window_sum, window_count = 0.0, 0
                    if held is not None:
                        held.clear()
                    continue
                window_bad = True  # DDP: kept out of the sums; the boundary decides
            else:
                state.epoch_loss_sum += value * logged
                state.epoch_loss_count += 1
                window_sum += value * logged
                window_count += 1
            if replaced is not None and replaced.window is not None:
                # The window was replayed after a back-off: its losses were recomputed.
                total, count = replaced.window
                state.epoch_loss_sum += total - window_sum
                state.epoch_loss_count += count - window_count
                window_sum, window_count = total, count
            if acc.pending == 0:  # a boundary (stepped, skipped by the GradScaler, dropped)
                if held is not None:
                    held.clear()
                if stepped:
                    state.step += 1
                    mean = window_sum / window_count if window_count else math.nan
                    state.step_losses.append(mean)
                    records.append((state.step, state.epoch, mean))
                    if on_step is not None:
                        on_step(state)
                window_sum, window_count, window_bad = 0.0, 0, False
                if (agreement.boundary() if agreement is not None  # = should_stop(), inlined
                        else stop is not None and stop.is_set()):
                    _restore_window(acc, window)
                    return EpochTotals(micro, samples, time.perf_counter() - started, True)
            if progress is not None:
                now = time.perf_counter()
                if now >= next_ui:
                    next_ui = now + UI_INTERVAL_S
                    progress.update(state, value, samples / max(now - started, 1e-9))
        # A loader that yielded fewer batches than batches_per_epoch: step what is there.
        if acc.pending:
            try:
                flushed = acc.flush()
            except NonFiniteGradients:
                acc.reset()
                flushed = False
                _drop_window(parts, state, window_bad, window_sum, window_count)
            if flushed:
                state.step += 1
                mean = window_sum / max(window_count, 1)
                state.step_losses.append(mean)
                records.append((state.step, state.epoch, mean))
                if on_step is not None:
                    on_step(state)
        # The epoch's losses become the global means, and the ranks agree on the stop flag
        # here too: with epochs shorter than the agreement period this is the only
        # agreement, so its answer must stop the run (the epoch's last boundary).
        stopped = (agreement.agree() if agreement is not None
                   else stop is not None and stop.is_set())
        _restore_window(acc, window)
        return EpochTotals(micro, samples, time.perf_counter() - started, stopped)
    finally:
        if guard is not None:
            guard.remove()


def _backward_bad(acc: Accumulator, guard: FiniteGuard | None, loss: Tensor) -> bool:
    """A non-finite loss. One process decides on it before backward (no backward). Under
    DDP every rank must run backward (the all-reduce needs all): with the guard's poison,
    so the guard stops the step on every rank at the window's boundary."""
    if guard is None:
        return False
    return acc.backward(guard.poison(loss))


def _restore_window(acc: Accumulator, window: int) -> None:
    if acc.pending == 0:  # the epoch's last step: evaluation and saving need no gradients
        acc.zero_grad()
    if (acc.steps != window or acc.window_samples is not None) and acc.pending == 0:
        acc.set_steps(window)


def _drop_window(parts: LoopParts, state: TrainState, local: bool, window_sum: float,
                 window_count: int) -> None:
    """DDP: the window's all-reduced gradients are non-finite on every rank (checked
    before the optimizer step). ``stop`` raises on every rank; ``skip`` takes the
    window's losses out of the epoch's sums and counts the skipped step."""
    if parts.on_nonfinite == "stop":
        where = (f"at step {state.step + 1} (epoch {state.epoch + 1}, batch "
                 f"{state.batch_in_epoch})")
        seen = (f"a non-finite loss on rank {parts.rank}" if local else
                f"non-finite gradients after the all-reduce (a non-finite loss on another "
                f"rank; this is rank {parts.rank})")
        raise NonFiniteLossError(
            f"{seen} {where}: training stopped on every rank before the update reached "
            "the weights. Lower --lr, add --clip-norm, check the data for NaN/inf, or pass "
            "--on-nonfinite skip to drop such steps."
        )
    parts.accumulator.reset()
    state.epoch_loss_sum -= window_sum
    state.epoch_loss_count -= window_count
    state.skipped_steps += 1


def _handle_nonfinite(parts: LoopParts, state: TrainState, value: float, local: bool) -> None:
    where = f"at step {state.step + 1} (epoch {state.epoch + 1}, batch {state.batch_in_epoch})"
    if parts.on_nonfinite == "stop":
        seen = (f"loss {value} on rank {parts.rank}" if local
                else f"a non-finite loss on another rank (this is rank {parts.rank})")
        raise NonFiniteLossError(
            f"{seen} {where}: training stopped before the update reached "
            "the weights. Lower --lr, add --clip-norm, check the data for NaN/inf, or pass "
            "--on-nonfinite skip to drop such steps."
        )
    # skip: drop the whole accumulation window (its gradients are partial) and count it.
    parts.accumulator.reset()
    state.skipped_steps += 1
