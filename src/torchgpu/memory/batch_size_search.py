"""Find the largest micro-batch that fits: grow by doubling, then binary-search.

:func:`find_batch_size` calls ``try_step(n)`` -- one forward/backward (and optimizer
step, if you want its memory counted) at micro-batch ``n`` -- and treats an
out-of-memory error (:func:`torchgpu.memory.oom.is_oom`) as "does not fit"; any other error is
re-raised untouched. After every probe the ranks agree: a probe failed if it failed on
*any* rank (one collective, the minimum over ranks of "1 if it fit"). Every rank
therefore walks the same sequence of probes and returns the same size, and with GPUs of
different sizes that size is what the smallest one fits -- which is what DDP needs,
since every rank runs the same micro-batch.

The search is exact for a monotone memory limit (``n`` fits implies ``n - 1`` fits):
it returns the largest ``n`` in ``[1, max_size]`` that fits, using about
``2 * log2(n)`` probes. :func:`keep_effective` then cuts the user's effective batch into
micro-batches no larger than that, with gradient accumulation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from torchgpu.errors import ConfigError, OutOfMemoryBackoffError
from torchgpu.memory.oom import FIX_HINT, Agree, default_agree, is_oom, release_memory, split_batch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """One trial: micro-batch ``size`` and whether it fit on every rank."""

    size: int
    fits: bool


@dataclass(frozen=True)
class BatchSearchResult:
    """The largest micro-batch that fits, and the probes that found it (in order).

    ``capped`` is True when ``size`` is ``max_size`` and it fit: the device may hold more.
    """

    size: int
    probes: tuple[Probe, ...]
    capped: bool

    def describe(self) -> str:
        """One line for the log: the size and the probes, e.g. ``... 64 ok, 128 OOM ...``."""
        trail = ", ".join(f"{p.size} {'ok' if p.fits else 'OOM'}" for p in self.probes)
        more = " (the search cap; more may fit)" if self.capped else ""
        return f"largest micro-batch that fits: {self.size}{more} [probes: {trail}]"


def find_batch_size(
    try_step: Callable[[int], None],
    start: int = 1,
    max_size: int = 65536,
    agree: Agree | None = None,
    release: Callable[[], None] | None = None,
) -> BatchSearchResult:
    """The largest micro-batch in ``[1, max_size]`` for which ``try_step`` does not OOM.

    Grows from ``start`` by doubling until a probe fails or ``max_size`` is reached, then
    binary-searches between the last size that fit and the first that failed (below
    ``start`` if ``start`` itself fails). ``agree`` returns the minimum of an int over all
    ranks (default :func:`torchgpu.collectives.agree_min`, the identity without a
    process group): collective, so every rank must call this function together.
    ``release`` runs after each failed probe (default: garbage collection and
    ``torch.cuda.empty_cache()`` when CUDA is initialised); ``try_step`` should not keep
    references to its tensors.

    Raises :class:`OutOfMemoryBackoffError` if even a micro-batch of 1 does not fit, and
    :class:`ConfigError` for ``start``/``max_size`` below 1 or ``start > max_size``.
    """
    if start < 1 or max_size < 1 or start > max_size:
        raise ConfigError(
            f"find_batch_size(start={start}, max_size={max_size}): need 1 <= start <= max_size; "
            "pass a start no larger than the data set or the cap"
        )
    agree_fn = agree if agree is not None else default_agree()
    release_fn = release if release is not None else release_memory
    probes: list[Probe] = []

    def probe(size: int) -> bool:
        fits_here = True
        try:
            try_step(size)
        except Exception as error:  # non-OOM errors leave through the raise below
            if not is_oom(error):
                raise
            fits_here = False
            del error  # drop the traceback (and the failed step's tensors) before release
        if not fits_here:
            release_fn()
        fits = int(agree_fn(1 if fits_here else 0)) == 1
        probes.append(Probe(size, fits))
        log.debug("batch-size probe %d: %s", size, "fits" if fits else "out of memory")
        return fits

    fit, fail = 0, 0  # largest size known to fit, smallest known to fail (0: none yet)
    size = start
    while True:
        if probe(size):
            fit = size
            if size >= max_size:
                break
            size = min(2 * size, max_size)
        else:
            fail = size
            break
    if fail:
        while fail - fit > 1:
            mid = (fit + fail) // 2
            if probe(mid):
                fit = mid
            else:
                fail = mid
    if fit == 0:
        raise OutOfMemoryBackoffError(
            "out of memory even at micro-batch 1 while searching for a batch size "
            f"(probes: {', '.join(str(p.size) for p in probes)}): one sample's step does not "
            f"fit on at least one rank's device. {FIX_HINT}."
        )
    return BatchSearchResult(size=fit, probes=tuple(probes), capped=fail == 0)


def keep_effective(
    effective_batch: int | None, micro: int, require_exact: bool = False
) -> tuple[int, int]:
    """``(micro_batch, accumulate)`` that keep ``effective_batch`` with micro-batches of at
    most ``micro`` (the size :func:`find_batch_size` found).

    ``effective_batch=None`` (the user gave none) gives ``(micro, 1)``. When the effective
    batch fits in one micro-batch it is used as is. Otherwise accumulation makes up the
    difference, exactly when the effective batch has a divisor within a factor 2 of
    ``micro`` (always with ``require_exact``), else rounded up by less than one sample
    per micro-step -- the rule of :func:`torchgpu.memory.oom.split_batch`.

    >>> keep_effective(256, 100)
    (64, 4)
    >>> keep_effective(None, 100)
    (100, 1)
    """
    if effective_batch is None:
        return micro, 1
    split = split_batch(effective_batch, micro, require_exact)
    return split.micro_batch, split.accumulate
