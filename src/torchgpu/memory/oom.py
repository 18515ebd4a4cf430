"""Out-of-memory back-off: halve the micro-batch, double accumulation, keep the effective batch.

When a training step runs out of memory, the cheapest fix that keeps the arithmetic
of training the same is to do the same step in smaller pieces: micro-batch ``m`` with
``k`` accumulation steps becomes ``m/2`` with ``2k``, so the effective batch
``m * k`` (what the optimizer sees) is unchanged. :class:`OOMBackoff` keeps that state
and decides each step down; the training loop does the retry.

Typical use in a loop (single process or DDP alike)::

    backoff = OOMBackoff(micro_batch=64, accumulate=1, device=device)
    while True:
        error = None
        try:
            run_window(backoff.micro_batch, backoff.accumulate)   # forward + backward + step
        except Exception as caught:          # non-OOM errors are re-raised by check()
            error = caught
        decision = backoff.check(error)      # collective under DDP: every rank calls it
        if decision is None:
            break                            # no rank ran out of memory
        release_failed_step(model, optimizer, error)
        accumulator.set_steps(decision.accumulate)   # and re-batch the data

Odd micro-batches. Halving ``m`` exactly is only possible when ``m`` is even. The new
micro-batch is chosen by :func:`split_batch` with a cap of ``ceil(m / 2)``: the largest
divisor ``d`` of the effective batch ``E`` with ``d <= cap`` keeps ``E`` exact, and is
taken whenever ``d >= cap / 2`` (it costs at most one extra halving's worth of
micro-steps). Otherwise -- ``E`` has no divisor near the cap, e.g. a prime ``E = 127``
-- the exact split would mean micro-batches far smaller than needed (127 steps of 1),
so the micro-batch becomes ``ceil(E / a)`` with ``a = ceil(E / cap)`` steps, and the
effective batch grows by less than one sample per micro-step (127 -> 64 x 2 = 128).
Such a decision has ``exact=False``; pass ``require_exact=True`` to always keep ``E``.

DDP. If one rank runs out of memory and the others do not, the ranks must still take
the same decision, or the next collective hangs. :meth:`OOMBackoff.check` is therefore
collective: every rank calls it after every attempt, with the error it caught or
``None``; the ranks agree on "any rank ran out of memory" and on the new micro-batch
through one injectable ``agree`` callable (the minimum of an int over ranks,
:func:`torchgpu.collectives.agree_min` by default, which is the identity without a
process group). Under DDP the gradient all-reduce runs inside ``backward``, so a rank
that fails before reaching it leaves the others waiting there; the loop must reach the
agreement before that collective (run the micro-steps under ``no_sync`` and agree
before the synchronising backward), which is the loop's part of the contract.
"""

from __future__ import annotations

import gc
import math
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from torchgpu.devices.cuda_status import cuda_initialized
from torchgpu.errors import ConfigError, OutOfMemoryBackoffError, first_line

if TYPE_CHECKING:
    from torch import nn

#: The minimum of an int over all ranks; the identity in a single process.
Agree = Callable[[int], int]

# Substrings of RuntimeError messages that mean "an allocator ran out of memory", for
# allocators that do not raise torch.OutOfMemoryError: the CPU's; a CUDA/HIP runtime or
# driver call that failed to allocate (torch.AcceleratorError, a RuntimeError, from
# torch 2.9; plain RuntimeError before); the math libraries' workspaces; and caching-
# allocator messages re-wrapped as plain RuntimeError by extensions. Each is the exact
# wording torch or the library prints for an allocation failure -- not a bare "out of
# memory", which would also take errors that a smaller batch does not cure.
_OOM_MESSAGES = (
    "CUDA out of memory",  # the caching allocators (torch.OutOfMemoryError when unwrapped)
    "HIP out of memory",
    "XPU out of memory",
    "MPS backend out of memory",
    "CUDA error: out of memory",  # cudaErrorMemoryAllocation from a runtime call
    "HIP error: out of memory",
    "hipErrorOutOfMemory",  # older ROCm names the error code instead
    "CUDA driver error: out of memory",  # CUDA_ERROR_OUT_OF_MEMORY from a driver call
    "DefaultCPUAllocator: can't allocate memory",  # CPU: activations scale with the batch
    "CUBLAS_STATUS_ALLOC_FAILED",
    "HIPBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUSOLVER_STATUS_ALLOC_FAILED",
    "CUSPARSE_STATUS_ALLOC_FAILED",
    "CUFFT_ALLOC_FAILED",
    "miopenStatusAllocFailed",
)

FIX_HINT = (
    "Fix: enable activation checkpointing (--activation-checkpointing), lower the precision "
    "(--precision bf16), use a smaller model, or spread the model over several devices "
    "(--strategy pipeline or --strategy fsdp); `torchgpu plan` shows which of these fits"
)


def is_oom(error: BaseException | None) -> bool:
    """True when ``error`` is an out-of-memory error from any torch allocator.

    Recognises :class:`torch.OutOfMemoryError` (``torch.cuda.OutOfMemoryError`` is the
    same class) and RuntimeErrors (``torch.AcceleratorError`` among them) carrying an
    allocator's out-of-memory message: the caching allocators' ``CUDA``/``HIP``/``XPU out
    of memory``, a runtime or driver call's ``CUDA error: out of memory`` (and HIP's),
    the CPU allocator's ``DefaultCPUAllocator: can't allocate memory``, and the math
    libraries' ``*_ALLOC_FAILED`` statuses. Other device errors are not (an illegal
    memory access, a device-side assert, cuDNN's ``CUDNN_STATUS_NOT_SUPPORTED``): a
    smaller micro-batch would only hide them. Python's own
    :class:`MemoryError` (and so :class:`OutOfMemoryBackoffError`) is not one: it means
    the host process itself is exhausted, which a smaller micro-batch does not cure.
    """
    if error is None:
        return False
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, RuntimeError):
        message = str(error)
        return any(text in message for text in _OOM_MESSAGES)
    return False


def default_agree() -> Agree:
    """:func:`torchgpu.collectives.agree_min`: the minimum over ranks, identity when not
    distributed. Imported on first use so this module stays cheap to import."""
    from torchgpu.collectives import agree_min

    agree: Agree = agree_min
    return agree


@dataclass(frozen=True)
class BatchSplit:
    """An effective batch cut into ``accumulate`` micro-batches of ``micro_batch``.

    ``exact`` is True when ``micro_batch * accumulate`` equals the requested effective
    batch; otherwise ``effective_batch`` is the (slightly larger) batch actually used.
    """

    micro_batch: int
    accumulate: int
    exact: bool

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step: ``micro_batch * accumulate``."""
        return self.micro_batch * self.accumulate


def split_batch(
    effective_batch: int,
    max_micro_batch: int,
    require_exact: bool = False,
    min_micro_batch: int = 1,
) -> BatchSplit:
    """Cut ``effective_batch`` into micro-batches of at most ``max_micro_batch``.

    Exact when possible at a reasonable cost: the largest divisor ``d`` of the effective
    batch with ``d <= max_micro_batch`` is used if ``2 * d >= max_micro_batch`` (or always
    with ``require_exact``). Otherwise ``accumulate = ceil(E / max)`` steps of
    ``ceil(E / accumulate)`` samples, which overshoots ``E`` by less than ``accumulate``.
    No micro-batch goes below ``min_micro_batch`` (an exact divisor below it is not
    used, even with ``require_exact``).

    >>> split_batch(64, 32)
    BatchSplit(micro_batch=32, accumulate=2, exact=True)
    >>> split_batch(127, 64)
    BatchSplit(micro_batch=64, accumulate=2, exact=False)
    """
    if effective_batch < 1 or max_micro_batch < 1:
        raise ConfigError(
            f"cannot split an effective batch of {effective_batch} into micro-batches of at "
            f"most {max_micro_batch}: both must be positive integers; pass a batch size >= 1"
        )
    if max_micro_batch >= effective_batch:
        return BatchSplit(effective_batch, 1, True)
    divisor = max(d for d in _divisors(effective_batch) if d <= max_micro_batch)
    if divisor >= min_micro_batch and (require_exact or 2 * divisor >= max_micro_batch):
        return BatchSplit(divisor, effective_batch // divisor, True)
    accumulate = math.ceil(effective_batch / max_micro_batch)
    micro = max(min_micro_batch, math.ceil(effective_batch / accumulate))
    return BatchSplit(micro, accumulate, micro * accumulate == effective_batch)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


@dataclass(frozen=True)
class BackoffDecision:
    """One step of the back-off: from ``previous_*`` to the new micro-batch/accumulation.

    ``effective_batch`` is ``micro_batch * accumulate``; ``exact`` says whether it equals
    the effective batch the back-off started with (see the module docstring for when it
    cannot). ``reason`` is the first line of the out-of-memory message, or a note that
    another rank ran out.
    """

    micro_batch: int
    accumulate: int
    previous_micro_batch: int
    previous_accumulate: int
    effective_batch: int
    exact: bool
    attempt: int
    reason: str

    def describe(self) -> str:
        """One line for the log, e.g. ``out of memory at micro-batch 64: now 32 x 2 ...``."""
        kept = "kept" if self.exact else "changed"
        return (
            f"out of memory at micro-batch {self.previous_micro_batch} "
            f"(x{self.previous_accumulate} accumulation): now micro-batch {self.micro_batch} "
            f"x{self.accumulate} accumulation, effective batch {self.effective_batch} ({kept})"
        )


class OOMBackoff:
    """Micro-batch / accumulation state that steps down on every out-of-memory error.

    ``micro_batch`` and ``accumulate`` are the starting values; their product is the
    effective batch the back-off keeps. ``min_micro_batch`` is the floor: an OOM there
    raises :class:`OutOfMemoryBackoffError` with the numbers and the fix. ``device``
    (optional) is named in that error, with its memory figures when CUDA is initialised.
    ``agree`` returns the minimum of an int over all ranks (see the module docstring);
    tests inject a fake, the default is :func:`torchgpu.collectives.agree_min`.
    """

    def __init__(
        self,
        micro_batch: int,
        accumulate: int = 1,
        min_micro_batch: int = 1,
        *,
        device: torch.device | str | None = None,
        agree: Agree | None = None,
        require_exact: bool = False,
        outer_accumulate: int = 1,
    ) -> None:
        """``outer_accumulate`` only shapes messages: when the caller already accumulates
        ``outer_accumulate`` such batches per optimizer step (the training loop backs off
        within each loader batch), the effective batch it reports is multiplied by it."""
        if micro_batch < 1 or accumulate < 1 or min_micro_batch < 1:
            raise ConfigError(
                f"OOMBackoff(micro_batch={micro_batch}, accumulate={accumulate}, "
                f"min_micro_batch={min_micro_batch}): all three must be integers >= 1"
            )
        self.micro_batch = micro_batch
        self.accumulate = accumulate
        self.min_micro_batch = min_micro_batch
        self.target_effective_batch = micro_batch * accumulate
        self.device = None if device is None else torch.device(device)
        self.require_exact = require_exact
        self.outer_accumulate = max(1, outer_accumulate)
        self.history: list[BackoffDecision] = []
        self._agree = agree

    @property
    def effective_batch(self) -> int:
        """Samples per optimizer step now: ``micro_batch * accumulate``."""
        return self.micro_batch * self.accumulate

    def agree_min(self, value: int) -> int:
        """The minimum of ``value`` over all ranks (collective under DDP)."""
        agree = self._agree if self._agree is not None else default_agree()
        return int(agree(int(value)))

    def check(self, error: BaseException | None) -> BackoffDecision | None:
        """Collective: decide, on every rank alike, whether to back off after an attempt.

        ``error`` is what this rank's attempt raised, or ``None``. A non-OOM error is
        re-raised untouched at once (it is never swallowed; under torchrun the failed
        process takes the job down). Returns ``None`` when no rank ran out of memory,
        else the :class:`BackoffDecision` every rank now follows. Raises
        :class:`OutOfMemoryBackoffError` (chained to ``error``) at the floor.
        """
        if error is not None and not is_oom(error):
            raise error
        oom_here = error is not None
        # One int carries both agreements: min over ranks of "1 if fine else 0" is
        # "every rank was fine", and it saves a second collective.
        if self.agree_min(0 if oom_here else 1) == 1:
            return None
        reason = ("another rank ran out of memory" if error is None
                  else first_line(error, typed=False))
        return self._back_off(reason, error)

    def on_oom(self, error: BaseException) -> BackoffDecision:
        """Back off after ``error``, which must be an out-of-memory error (anything else
        is re-raised untouched). Same as :meth:`check` with an error: collective under
        DDP, where the ranks that did not fail call ``check(None)`` at the same point."""
        decision = self.check(error)
        if decision is None:  # only a wrong ``agree`` can say "nobody failed" here
            raise error
        return decision

    def _back_off(self, reason: str, error: BaseException | None) -> BackoffDecision:
        if self.micro_batch <= self.min_micro_batch:
            raise self._cannot_fit(reason) from error
        cap = max(self.min_micro_batch, math.ceil(self.micro_batch / 2))
        split = self._split(cap)
        micro = self.agree_min(split.micro_batch)
        if micro != split.micro_batch:  # a rank started from other numbers: follow the smallest
            split = self._split(micro)
        decision = BackoffDecision(
            micro_batch=split.micro_batch,
            accumulate=split.accumulate,
            previous_micro_batch=self.micro_batch,
            previous_accumulate=self.accumulate,
            effective_batch=split.effective_batch,
            exact=split.effective_batch == self.target_effective_batch,
            attempt=len(self.history) + 1,
            reason=reason,
        )
        self.micro_batch, self.accumulate = split.micro_batch, split.accumulate
        self.history.append(decision)
        return decision

    def _split(self, cap: int) -> BatchSplit:
        return split_batch(
            self.target_effective_batch, cap, self.require_exact, self.min_micro_batch
        )

    def _cannot_fit(self, reason: str) -> OutOfMemoryBackoffError:
        steps = [d.previous_micro_batch for d in self.history] + [self.micro_batch]
        path = " -> ".join(str(s) for s in steps)
        where = str(self.device) if self.device is not None else "this device"
        figures = memory_figures(self.device)
        return OutOfMemoryBackoffError(
            f"out of memory at micro-batch {self.micro_batch} on {where} "
            f"(effective batch {self.target_effective_batch * self.outer_accumulate}; "
            f"back-off went {path}), the "
            f"smallest micro-batch allowed, so one step cannot fit on this device"
            f"{'; ' + figures if figures else ''}. Last error: {reason}. {FIX_HINT}."
        )


def memory_figures(device: torch.device | None) -> str:
    """Memory numbers for ``device`` as one phrase, or "" when none can be read cheaply.

    Only reads CUDA figures when CUDA is already initialised, so it never starts CUDA.
    """
    if device is None or device.type != "cuda" or not cuda_initialized():
        return ""
    gib = 1024**3
    try:
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        peak = torch.cuda.max_memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
    except RuntimeError:  # a broken context must not hide the real error
        return ""
    return (
        f"{device}: {total / gib:.2f} GiB total, {free / gib:.2f} GiB free, "
        f"{allocated / gib:.2f} GiB allocated by tensors (peak {peak / gib:.2f} GiB), "
        f"{reserved / gib:.2f} GiB reserved by the caching allocator"
    )


def release_memory() -> None:
    """Collect garbage and return cached CUDA blocks, without ever starting CUDA."""
    gc.collect()
    if cuda_initialized():
        torch.cuda.empty_cache()


def release_failed_step(
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None = None,
    error: BaseException | None = None,
) -> None:
    """Free what a failed step left behind, before retrying at a smaller micro-batch.

    Sets gradients to ``None`` (the accumulation window restarts from zero), drops the
    local variables of the frames in ``error``'s traceback (they hold the failed step's
    activations alive for as long as the exception object lives), collects garbage,
    and empties the CUDA cache only if CUDA is already initialised.
    """
    if model is not None:
        model.zero_grad(set_to_none=True)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if error is not None and error.__traceback__ is not None:
        traceback.clear_frames(error.__traceback__)
    release_memory()


