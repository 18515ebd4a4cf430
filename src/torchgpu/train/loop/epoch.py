"""The training loop: :func:`run_epoch` trains one epoch, the same path for every strategy.

Per micro-batch it sizes the window (the epoch's short last one included), moves the batch
and runs one step; the optimizer steps at window boundaries. After each boundary
``on_step(state)`` runs (a save there is consistent) and the loop asks whether to stop;
under DDP the ranks' agreement decides, so all stop at the same boundary, and until it the
recorded losses are this rank's own: code needing the global values or a stop decided right
there calls :func:`sync_now` (a collective: every rank calls it). Epoch ``e``'s order is a
function of ``(seed, e)``, so a resumed run recreates it. Hot path (kept within 2% of a
hand-written loop): what does not change per step is decided before the loop; per step
there is no I/O, import, capability probe or module state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader

from torchgpu.data.batches import batch_rows
from torchgpu.data.workers import forking
from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.guards.agreement import FiniteGuard, NonFiniteGradients
from torchgpu.train.loop.loss_reader import LossReader, per_step_optimizer, reads_late
from torchgpu.train.loop.micro_step import MicroStep
from torchgpu.train.loop.parts import LoopParts, ProgressSink, Window
from torchgpu.train.loop.tail import TailWindows
from torchgpu.train.loop.window import WindowLosses
from torchgpu.train.state import TrainState
from torchgpu.transfer import to_device

UI_INTERVAL_S = 0.1  # progress refresh period; the loop reads the clock, not the UI


@dataclass(frozen=True)
class EpochTotals:
    """What one call of :func:`run_epoch` did (this process only)."""

    micro_batches: int
    samples: int
    seconds: float
    # Stopped at a step boundary because the stop flag was set (under DDP: agreed), the
    # epoch's last boundary included: the caller saves and ends the run, no evaluation.
    stopped: bool
    # Of ``seconds``, the host time spent blocked in ``next()`` on the batches: waiting
    # for the loader (its workers, or __getitem__ and collation in this process) and, on
    # CUDA, the prefetcher queueing the next copy. No device sync is added to measure
    # it. On an accelerator the loop syncs at most once per optimizer step, and reading
    # the losses late not at all: the host may then run up to about a step ahead, so
    # part of a wait can be hidden behind queued GPU work and the share can overstate
    # how long the GPU itself starved (never understate it).
    data_wait_s: float = 0.0
    # Of ``data_wait_s``, the wait for the epoch's first batch: with DataLoader workers,
    # the loader filling up (one worker loads a whole batch before the first arrives),
    # which more workers cannot shorten.
    first_wait_s: float = 0.0

    @property
    def data_wait_share(self) -> float | None:
        """``data_wait_s`` over the epoch's training time (None when no time passed)."""
        return self.data_wait_s / self.seconds if self.seconds > 0 else None


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffling seed of ``epoch``: a fixed function of (seed, epoch)."""
    return (seed * 1_000_003 + epoch * 7919 + 12345) % (2**63 - 1)


class EpochBatches(Iterator[Any]):
    """An epoch's batches: the loader's iterator with its first ``skip`` batches dropped
    (still loaded: the order must be consumed exactly). :meth:`close` ends the
    iterator's worker processes now."""

    def __init__(self, iterator: Iterator[Any], skip: int = 0) -> None:
        self._iterator = iterator
        self._skip = skip

    def __next__(self) -> Any:
        while self._skip:
            self._skip -= 1
            next(self._iterator)
        return next(self._iterator)

    def close(self) -> None:
        """End the DataLoader workers of this epoch (a no-op without workers) rather than
        when the iterator is garbage collected: a raised error's traceback holds the
        loop's frame, and with it the iterator, for as long as the error is kept."""
        shutdown = getattr(self._iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()


def start_epoch(loader: Iterable[Any], seed: int, epoch: int, skip: int = 0) -> EpochBatches:
    """Iterate ``loader`` in epoch ``epoch``'s order, skipping the first ``skip`` batches.

    Re-seeds the loader's generator with :func:`epoch_seed` and calls the sampler's
    (DistributedSampler) or batch sampler's (ShardBatches) ``set_epoch``, so the order
    depends only on (seed, epoch) — never on how many epochs this process has run.
    Skipped batches are still loaded (the order must be consumed exactly), then dropped;
    a stream's loader (:class:`~torchgpu.data.stream_loader.StreamLoader`, whose
    ``begin_epoch`` starts the pass) skips the items without collating them, or
    continues from a saved state.
    """
    for name in ("sampler", "batch_sampler"):  # DistributedSampler; ShardBatches
        sampler = getattr(loader, name, None)
        if sampler is not None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(epoch)
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator):
        generator.manual_seed(epoch_seed(seed, epoch))
    begin = getattr(loader, "begin_epoch", None)
    if begin is not None:  # a stream (torchgpu.data.stream_loader) skips inside its pass
        skip = begin(epoch, skip)
    with forking():  # DataLoader workers fork here
        return EpochBatches(iter(loader), skip)


def loads_ahead(loader: Iterable[Any]) -> bool:
    """Whether the next epoch's iterator may be started before this epoch ends, so its
    DataLoader workers fork and fill their queues while this epoch's last batches train
    and it is evaluated, rather than at the next epoch's first batch (with short epochs
    that start-up was most of the time a GPU waited for data: one worker decodes a whole
    batch before the first arrives). Only a plain ``DataLoader`` with workers and its own
    generator: starting its iterator then draws nothing from the global RNG (the workers'
    base seed comes from the generator :func:`start_epoch` seeds per epoch), so the run's
    random state, and a resumed run's, are the same whenever it starts."""
    return (type(loader) is DataLoader and loader.num_workers > 0
            and isinstance(loader.generator, torch.Generator))


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


def agreed_steps(parts: LoopParts) -> int | None:
    """The last optimizer step whose recorded loss is final: under DDP the last agreed
    one (later records hold this rank's own values); None (all) without agreement."""
    return parts.agreement.agreed_steps if parts.agreement is not None else None


def run_epoch(
    parts: LoopParts,
    batches: Iterable[tuple[Any, Any]],
    state: TrainState,
    *,
    batches_per_epoch: int,
    stop: StopFlag | None = None,
    on_step: Callable[[TrainState], None] | None = None,
    progress: ProgressSink | None = None,
    records: list[tuple[int, int, float]] | None = None,
    settle: Callable[[int], bool] | None = None,
    ahead: Callable[[], None] | None = None,
    ahead_left: int = 0,
) -> EpochTotals:
    """Train over ``batches`` (the rest of epoch ``state.epoch``), advancing ``state``.

    ``batches_per_epoch`` is the epoch's full length: the last window is shortened to the
    micro-batches left, so it is a real, synchronised boundary under DDP whose gradient is
    the window's (sample-weighted with ``parts.layout``) mean. ``records`` receives
    ``(step, epoch, loss)`` per optimizer step. Returns at the epoch end or at the first
    boundary where the stop flag is set (under DDP: agreed); ``stopped`` is True when the
    flag ended it, even at the epoch's last boundary. A non-finite loss is acted on
    (``parts.on_nonfinite``) before the optimizer step: the weights never see it.

    ``settle`` (None: never) lets the loop read the losses one step late where the
    optimizer can skip a step on the device's word (``loss_reader.reads_late``): no host
    sync per step; a step's record and ``on_step`` then run at the next step's start,
    except at the steps for which ``settle(step)`` is True (a checkpoint is due: its
    ``on_step`` must see the step's exact state), which settle at their own boundary (one
    sync), as do a stop's step and the epoch's last, before the loop returns.

    ``ahead`` is called once, when ``ahead_left`` batches of the epoch are left to train
    on: the runner starts the next epoch's DataLoader workers there (``loads_ahead``), so
    they fork and fill their queues while this epoch's last batches train."""
    acc, device, target_device = parts.accumulator, parts.device, parts.target_device
    move = parts.move_batches
    records = [] if records is None else records
    # An accelerator reads the loss once per optimizer step (one host sync per step);
    # the CPU, where a read is no sync, per micro-batch (hooked is None; so too for a
    # strategy's own step, which reads its loss itself).
    hooked = per_step_optimizer(device, acc)
    guard, stop_here, stop_at_end = _agreement(parts, state, records, stop,
                                               hook=hooked is None)
    late = (hooked is not None and settle is not None and guard is None
            and parts.step is None
            and reads_late(hooked, acc, accumulate=parts.accumulate,
                           on_nonfinite=parts.on_nonfinite))
    reader = LossReader(hooked, guard, late=late) if hooked is not None else None
    # The stage pipeline brings its own step (one schedule over every stage); every other
    # strategy: forward, loss, backward through the accumulator, back-off and guard inside.
    step = parts.step if parts.step is not None else MicroStep(parts, guard, reader).run
    losses = WindowLosses(state, records, acc, on_step=on_step, on_nonfinite=parts.on_nonfinite,
                          rank=parts.rank, distributed=guard is not None, reader=reader)
    if late:
        assert reader is not None and settle is not None
        reader.before_step = losses.settle
    settles = settle if settle is not None else _always
    window = parts.accumulate
    tail = TailWindows(parts.layout, window, batches_per_epoch, parts.loss_fn)
    tail_from = tail.start  # sys.maxsize: no short batch in this epoch
    loss_fn, logged = parts.loss_fn, 1.0  # logged: this batch's factor in the logged means
    first_batch, first_sample = state.batch_in_epoch, state.samples
    if not parts.model.training:  # model.train() walks every module (15 us on a small net)
        parts.model.train()
    source, waited = iter(batches), 0.0  # waited: seconds blocked in next(source)
    first_wait = -1.0  # the first batch's part of it, once it came
    started = fetch = time.perf_counter()  # fetch: when the loop asked for this batch
    next_ui = started + UI_INTERVAL_S

    def totals(stopped: bool) -> EpochTotals:
        losses.settle()  # a held window (the last step, or a stop's) is recorded first
        _restore_window(acc, window, free=device.type != "cpu")
        return EpochTotals(state.batch_in_epoch - first_batch, state.samples - first_sample,
                           time.perf_counter() - started, stopped, waited,
                           max(first_wait, 0.0))

    try:
        while True:
            try:
                x, y = next(source)
            except StopIteration:
                break
            waited += time.perf_counter() - fetch
            if first_wait < 0:
                first_wait = waited
            n = x.shape[0] if isinstance(x, Tensor) else batch_rows(x)
            if state.batch_in_epoch >= tail_from:  # windows holding a short micro-batch
                loss_fn = tail.loss_fn  # an empty batch (a DDP rank's share) gives zero
                logged = tail.batch(acc, state.batch_in_epoch, n)
            elif window > 1 and acc.pending == 0:  # the epoch's last window is what is left
                _size_window(acc, window, batches_per_epoch - state.batch_in_epoch)
            if move:
                x, y = _moved(x, y, device)
            if target_device is not None:
                y = to_device(y, target_device, non_blocking=True)
            if acc.pending == 0:  # a window starts: free the last step's gradients now,
                acc.zero_grad()   # before the forward, as a hand-written loop does
            value, bad, stepped, outcome = step(x, y, n, loss_fn)
            state.batch_in_epoch += 1
            state.samples += n
            if ahead is not None and batches_per_epoch - state.batch_in_epoch <= ahead_left:
                ahead()
                ahead = None
            losses.add(value, bad, logged, outcome)
            if acc.pending == 0:  # a boundary (stepped, skipped, dropped or replayed)
                losses.close(stepped, hold=late and not settles(state.step + 1))
                if stop_here():
                    return totals(True)
            # One clock read: the next batch's fetch starts now, and the progress line
            # refreshes when it is due (its own time is then not counted as a wait).
            fetch = time.perf_counter()
            if progress is not None and fetch >= next_ui:
                next_ui = fetch + UI_INTERVAL_S
                progress.update(state, losses.last, (state.samples - first_sample)
                                / max(fetch - started, 1e-9))
                fetch = time.perf_counter()
        if acc.pending:  # a loader that yielded fewer batches than batches_per_epoch
            losses.close(_flush(acc, losses))
        # The epoch's losses become the global means, and the ranks agree on the stop flag
        # here too: with epochs shorter than the agreement period this is the only
        # agreement, so its answer must stop the run (the epoch's last boundary).
        return totals(stop_at_end())
    finally:
        if guard is not None:
            guard.remove()
        if reader is not None:
            reader.remove()


def _agreement(parts: LoopParts, state: TrainState, records: list[tuple[int, int, float]],
               stop: StopFlag | None, *, hook: bool) -> tuple[
                   FiniteGuard | None, Callable[[], bool], Callable[[], bool]]:
    """The epoch's stop checks, at each boundary and at the end, and DDP's finite guard.

    One process: the stop flag, read. DDP: the ranks' agreement (a collective only when
    one is due at a boundary, always at the end) and the guard on the optimizer step
    (``hook``: its own step pre-hook; else the loss reader asks it)."""
    agreement = parts.agreement if parts.agree else None
    if agreement is None:
        flag = stop.is_set if stop is not None else _never
        return None, flag, flag
    agreement.begin(state, records, stop)
    return FiniteGuard(parts.accumulator, hook=hook), agreement.boundary, agreement.agree


def _never() -> bool:
    return False


def _always(step: int) -> bool:
    return True


def _moved(x: Any, y: Any, device: torch.device) -> tuple[Any, Any]:
    same = y is x  # a dict batch is its own target
    x = to_device(x, device, non_blocking=True)
    return x, x if same else to_device(y, device, non_blocking=True)


def _size_window(acc: Window, window: int, left: int) -> None:
    """At a window's start: as long as configured, or what is left of the epoch."""
    wanted = left if 0 < left < window else window
    if acc.steps != wanted:
        acc.set_steps(wanted)


def _flush(acc: Window, losses: WindowLosses) -> bool:
    """Step on the epoch's partial last window; under DDP its gradients may turn out
    non-finite (the guard), which drops the window."""
    try:
        return acc.flush()
    except NonFiniteGradients:
        acc.reset()
        losses.drop(losses.bad)
        return False


def _restore_window(acc: Window, window: int, *, free: bool) -> None:
    """At the epoch's end: the configured window again, and with ``free`` the last step's
    gradients freed (an accelerator's memory is better spent on evaluation). On the CPU
    they stay until the next window's first forward, as in a hand-written loop: freeing
    them here changed glibc's heap enough to slow every later step of a 4x512 MLP by
    4-8% (bench overhead, medium)."""
    if free and acc.pending == 0:
        acc.zero_grad()
    if (acc.steps != window or acc.window_samples is not None) and acc.pending == 0:
        acc.set_steps(window)
