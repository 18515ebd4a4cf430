"""The training loop: plain functions over small pieces, no god object.

Per micro-batch: transfer (off-CPU only), autocast forward + loss, the non-finite
check, backward through the :class:`~torchgpu.accumulate.GradAccumulator` (which
steps at window boundaries). Per epoch: evaluation on the held-out split.

Hot path rules (the loop must stay within 2% of a hand-written loop): every decision
that does not change per step (transfer or not, distributed or not, progress or not)
is made before the loop; per step there is no I/O, no import, no capability probe.
The loss is read with one ``.item()`` per micro-batch (a host sync on GPU) because
the value feeds both the loss history and the non-finite check.

Checkpoint/resume hooks: ``on_step(state)`` runs after every optimizer step (a step
boundary, where a save is consistent); the stop flag is checked right after it. The
data order of epoch ``e`` is a function of ``(seed, e)`` (:func:`start_epoch`), so a
resumed run recreates it and skips ``state.batch_in_epoch`` micro-batches.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from torchgpu.errors import NonFiniteLossError
from torchgpu.train.state import StopFlag, TrainState

UI_INTERVAL_S = 0.1  # progress refresh period; the loop reads the clock, not the UI


class Accumulator(Protocol):
    """What the loop needs from :class:`torchgpu.accumulate.GradAccumulator`."""

    @property
    def steps(self) -> int: ...

    def micro_step(self) -> AbstractContextManager[Any]: ...

    def backward(self, loss: Tensor) -> bool: ...

    def set_steps(self, steps: int) -> None: ...

    def reset(self) -> None: ...

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


@dataclass(frozen=True)
class EpochTotals:
    """What one call of :func:`run_epoch` did (this process only)."""

    micro_batches: int
    samples: int
    seconds: float
    stopped: bool  # left early at a step boundary because the stop flag was set


@dataclass(frozen=True)
class EvalResult:
    """Held-out metrics: mean loss, and R² (regression) or accuracy (classification)."""

    loss: float
    r2: float | None
    accuracy: float | None
    samples: int


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffling seed of ``epoch``: a fixed function of (seed, epoch)."""
    return (seed * 1_000_003 + epoch * 7919 + 12345) % (2**63 - 1)


def start_epoch(loader: Iterable[Any], seed: int, epoch: int, skip: int = 0) -> Iterator[Any]:
    """Iterate ``loader`` in epoch ``epoch``'s order, skipping the first ``skip`` batches.

    Re-seeds the loader's generator with :func:`epoch_seed` and calls the sampler's
    ``set_epoch`` (DistributedSampler), so the order depends only on (seed, epoch) —
    never on how many epochs this process has run. Skipped batches are still loaded
    (the order must be consumed exactly), then dropped.
    """
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    generator = getattr(loader, "generator", None)
    if isinstance(generator, torch.Generator):
        generator.manual_seed(epoch_seed(seed, epoch))
    iterator = iter(loader)
    if skip:
        return itertools.islice(iterator, skip, None)
    return iterator


def _agree(flags: Tensor, bad: bool, stop: bool, value: float) -> tuple[bool, bool, float]:
    """One SUM all-reduce of [non-finite, stop, loss]: every rank gets the same decision,
    and the loss becomes the mean over ranks (the global batch's loss) for free."""
    import torch.distributed as dist

    flags[0] = float(bad)
    flags[1] = float(stop)
    flags[2] = 0.0 if bad else value
    dist.all_reduce(flags, op=dist.ReduceOp.SUM)
    got = flags.tolist()
    return got[0] > 0, got[1] > 0, got[2] / dist.get_world_size()


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
    synchronised boundary under DDP and its gradient is the mean over that window.
    ``records`` receives ``(step, epoch, loss)`` per optimizer step (in memory).
    Returns at the epoch end, or at the first step boundary after ``stop`` is set.
    Raises :class:`NonFiniteLossError` (on_nonfinite="stop") before a non-finite loss's
    gradients are computed, so the weights never see it.
    """
    model, loss_fn, acc = parts.model, parts.loss_fn, parts.accumulator
    # fp32 and 1-micro-batch windows need no context: nullcontext is ~5x cheaper than a
    # generator-based one, and this runs every step.
    autocast = (parts.precision.autocast if getattr(parts.precision, "dtype", True) is not None
                else nullcontext)
    micro_step = acc.micro_step if parts.accumulate > 1 else nullcontext
    device = parts.device
    move = parts.move_batches
    agree = parts.agree
    flags = torch.zeros(3, dtype=torch.float64, device=device) if agree else None
    window = parts.accumulate
    if records is None:
        records = []
    stop_seen = False
    window_sum = 0.0
    window_count = 0
    micro = 0
    samples = 0
    model.train()
    started = time.perf_counter()
    next_ui = started + UI_INTERVAL_S
    for x, y in batches:
        if window > 1 and acc.pending == 0:
            # At a boundary: the epoch's last window is as long as what is left of it.
            left = batches_per_epoch - state.batch_in_epoch
            wanted = left if 0 < left < window else window
            if acc.steps != wanted:
                acc.set_steps(wanted)
        if move:
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
        with micro_step():
            with autocast():
                loss = loss_fn(model(x), y)
            value = loss.item()
            local_bad = bad = not math.isfinite(value)
            if flags is not None:
                wants_stop = stop is not None and stop.is_set()
                bad, seen, mean = _agree(flags, bad, wants_stop, value)
                stop_seen = stop_seen or seen
                value = value if bad else mean
            stepped = False if bad else acc.backward(loss)
        n = x.shape[0]
        state.batch_in_epoch += 1
        state.samples += n
        micro += 1
        samples += n
        if bad:
            _handle_nonfinite(parts, state, value, local_bad)
            window_sum, window_count = 0.0, 0
            continue
        state.epoch_loss_sum += value
        state.epoch_loss_count += 1
        window_sum += value
        window_count += 1
        if acc.pending == 0:  # a boundary (stepped, or skipped by the fp16 GradScaler)
            if stepped:
                state.step += 1
                mean = window_sum / window_count
                state.step_losses.append(mean)
                records.append((state.step, state.epoch, mean))
                if on_step is not None:
                    on_step(state)
            window_sum, window_count = 0.0, 0
            if stop_seen or (not agree and stop is not None and stop.is_set()):
                _restore_window(acc, window)
                return EpochTotals(micro, samples, time.perf_counter() - started, True)
        if progress is not None:
            now = time.perf_counter()
            if now >= next_ui:
                next_ui = now + UI_INTERVAL_S
                progress.update(state, value, samples / max(now - started, 1e-9))
    # A loader that yielded fewer batches than batches_per_epoch: step what is there.
    if acc.pending and acc.flush():
        state.step += 1
        mean = window_sum / max(window_count, 1)
        state.step_losses.append(mean)
        records.append((state.step, state.epoch, mean))
        if on_step is not None:
            on_step(state)
    _restore_window(acc, window)
    return EpochTotals(micro, samples, time.perf_counter() - started, False)


def _restore_window(acc: Accumulator, window: int) -> None:
    if acc.steps != window and acc.pending == 0:
        acc.set_steps(window)


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


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[Tensor, Tensor]],
    loss_fn: LossFn,
    *,
    task: str,
    device: torch.device,
    precision: Autocaster | None = None,
) -> EvalResult:
    """Mean loss over ``batches`` plus R² (``task="regression"``) or accuracy.

    Sums are kept in float64 on the CPU; the model is put in eval mode and back into
    train mode afterwards. The caller chooses which batches (all ranks may evaluate
    the full held-out split; it is small and the result is then identical everywhere).
    """
    was_training = model.training
    model.eval()
    loss_total = 0.0
    count = 0
    sse = sum_y = sum_y2 = 0.0
    correct = 0
    try:
        for x, y in batches:
            x = x.to(device)
            y = y.to(device)
            if precision is not None:
                with precision.autocast():
                    out = model(x)
            else:
                out = model(x)
            out = out.float()
            n = int(x.shape[0])
            loss_total += float(loss_fn(out, y)) * n
            count += n
            if task == "regression":
                target = y.double().reshape(out.shape)
                sse += float(((out.double() - target) ** 2).sum())
                sum_y += float(target.sum())
                sum_y2 += float((target**2).sum())
            else:
                correct += int((out.argmax(dim=1) == y).sum())
    finally:
        model.train(was_training)
    if count == 0:
        return EvalResult(math.nan, None, None, 0)
    if task == "regression":
        total = sum_y2 - sum_y * sum_y / count
        r2 = 1.0 - sse / total if total > 0 else math.nan
        return EvalResult(loss_total / count, r2, None, count)
    return EvalResult(loss_total / count, None, correct / count, count)
