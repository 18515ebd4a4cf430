"""Choosing the number of micro-batches M by measuring it (the seed's split-size sweep).

Small M leaves stages idle (the bubble is ``(n-1)/(M+n-1)`` of the time); large M
makes many small kernels and per-micro-batch overhead. Where the optimum lies
depends on the model, batch and devices, so :func:`time_chunks` times a few real
training steps (forward, loss, backward) for each candidate M, rounds interleaved so
drift in machine load hits every candidate alike, and keeps the fastest median.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from torchgpu.errors import ConfigError
from torchgpu.parallel.microbatch import batch_size
from torchgpu.parallel.model import move

logger = logging.getLogger("torchgpu.parallel.chunks")

DEFAULT_CANDIDATES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def micro_batch_groups(rows: int, chunks: int) -> list[tuple[int, int]]:
    """How ``rows`` rows split into ``chunks`` micro-batches along dim 0 (the sizes of
    ``torch.tensor_split``; ``min(chunks, rows)`` of them), as runs of equal micro-batches
    ``[(count, rows_each), ...]`` in batch order: one run when ``chunks`` divides ``rows``,
    else two (the larger micro-batches first), e.g. ``(10, 4) -> [(2, 3), (2, 2)]``. Pure."""
    if rows < 1 or chunks < 1:
        raise ConfigError(
            f"cannot split {rows} rows into {chunks} micro-batches: both must be >= 1 "
            "(a non-empty batch and chunks=1 or more)"
        )
    m = min(chunks, rows)
    q, r = divmod(rows, m)
    return [(r, q + 1), (m - r, q)] if r else [(m, q)]


@dataclass(frozen=True)
class ChunkRow:
    """One candidate's measurement: step seconds over the timed steps.

    ``micro_batch_rows`` is the largest micro-batch, ``min_micro_batch_rows`` the
    smallest (equal when ``chunks`` divides the batch)."""

    chunks: int
    micro_batch_rows: int
    median_s: float
    min_s: float
    max_s: float
    min_micro_batch_rows: int = 0

    def rows_label(self) -> str:
        """``"4"`` for equal micro-batches, ``"3-4"`` for uneven ones."""
        low = self.min_micro_batch_rows or self.micro_batch_rows
        if low == self.micro_batch_rows:
            return str(self.micro_batch_rows)
        return f"{low}-{self.micro_batch_rows}"


@dataclass(frozen=True)
class ChunkChoice:
    """The chosen M and the sweep table, one row per candidate in sweep order."""

    chunks: int
    table: tuple[ChunkRow, ...]

    def format(self) -> str:
        """The table as text (the chosen row marked with ``*``)."""
        lines = [f"{'M':>4} {'rows':>6} {'median s':>10} {'min s':>10} {'max s':>10}"]
        for r in self.table:
            mark = " *" if r.chunks == self.chunks else ""
            lines.append(
                f"{r.chunks:>4} {r.rows_label():>6} {r.median_s:>10.4f} "
                f"{r.min_s:>10.4f} {r.max_s:>10.4f}{mark}"
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form."""
        return {"chunks": self.chunks, "table": [vars(r) for r in self.table]}


def default_candidates(batch_rows: int) -> list[int]:
    """The candidates tried by default: DEFAULT_CANDIDATES up to the batch size (a
    candidate that does not divide the batch runs uneven micro-batches; the sweep table
    shows their row range)."""
    return [m for m in DEFAULT_CANDIDATES if m <= max(batch_rows, 1)]


def even_candidates(batch_rows: int, candidates: Iterable[int] = DEFAULT_CANDIDATES
                    ) -> list[int]:
    """The candidates that split ``batch_rows`` into equal micro-batches of at least two
    rows each (M = 1 always), e.g. ``30 -> [1, 2, 3, 6]``: what a multi-process pipeline
    sweeps, where an uneven split costs a second schedule. Pure."""
    return [m for m in candidates
            if m == 1 or (batch_rows % m == 0 and batch_rows // m >= 2)]


def sweep_chunks(
    make_step: Callable[[int], Callable[[], None]],
    candidates: Sequence[int],
    batch_rows: int,
    steps: int = 3,
    warmup: int = 1,
    sync: Callable[[], None] | None = None,
) -> ChunkChoice:
    """Time ``make_step(M)()`` for every candidate M, ``warmup + steps`` interleaved
    rounds (warm-up rounds discarded), and choose the smallest median (ties: smaller M).

    ``make_step(M)`` returns a callable running one training step with M micro-batches;
    ``sync`` waits for queued device work (``torch.cuda.synchronize``) around each step.
    """
    cands = sorted({int(m) for m in candidates})
    if not cands or cands[0] < 1 or steps < 1:
        raise ConfigError(
            f"chunk sweep needs positive candidates and steps >= 1, got "
            f"candidates={list(candidates)}, "
            f"steps={steps}: e.g. candidates=[1, 2, 4, 8], steps=3"
        )
    fns = {m: make_step(m) for m in cands}
    times: dict[int, list[float]] = {m: [] for m in cands}
    done = sync or (lambda: None)
    for r in range(warmup + steps):
        for m in cands:
            done()
            start = time.perf_counter()
            fns[m]()
            done()
            if r >= warmup:
                times[m].append(time.perf_counter() - start)
    rows = tuple(
        ChunkRow(m, big, statistics.median(t), min(t), max(t), small)
        for m, t in times.items()
        for big, small in [_row_range(batch_rows, m)]
    )
    best = min(rows, key=lambda r: (r.median_s, r.chunks))
    choice = ChunkChoice(best.chunks, rows)
    logger.info("chunk sweep (fastest M=%d):\n%s", best.chunks, choice.format())
    return choice


def _row_range(batch_rows: int, chunks: int) -> tuple[int, int]:
    """(largest, smallest) micro-batch rows; (0, 0) for an unknown batch size."""
    if batch_rows < 1:
        return 0, 0
    sizes = [each for _, each in micro_batch_groups(batch_rows, chunks)]
    return max(sizes), min(sizes)


def _cuda_sync(devices: Iterable[torch.device]) -> Callable[[], None] | None:
    cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
    if not cuda:
        return None

    def sync() -> None:
        for d in cuda:
            torch.cuda.synchronize(d)

    return sync


class PipelineLike(Protocol):
    """What :func:`time_chunks` needs of a pipeline (a
    :class:`~torchgpu.parallel.pipeline.Pipeline`): settable ``chunks``, its layers'
    owner ``module``, ``devices``, ``output_device``, parameters and a call."""

    chunks: int
    __call__: Callable[..., object]

    @property
    def module(self) -> nn.Module: ...

    @property
    def devices(self) -> Sequence[torch.device]: ...

    @property
    def output_device(self) -> torch.device: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


def time_chunks(
    pipe: PipelineLike,
    sample_input: object,
    sample_target: object,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    candidates: Sequence[int] | None = None,
    steps: int = 3,
    warmup: int = 1,
) -> ChunkChoice:
    """Measure training steps of ``pipe`` for each candidate M and return the fastest
    (``pipe.chunks`` is left unchanged); :func:`torchgpu.parallel.pipeline.choose_chunks`
    is the public entry. Gradients, buffers (BatchNorm statistics) and the random
    number generators are restored afterwards; the weights are never stepped.
    """
    rows = batch_size(sample_input)
    cands = list(candidates) if candidates is not None else default_candidates(rows)
    params = list(pipe.parameters())
    saved_grads = [p.grad for p in params]
    saved_buffers = {k: v.detach().clone() for k, v in pipe.module.named_buffers()}
    original = pipe.chunks
    target = sample_target

    def make_step(m: int) -> Callable[[], None]:
        def step() -> None:
            # From no gradient: a backward adds into an existing .grad in place, which
            # would change the caller's saved gradients.
            for p in params:
                p.grad = None
            pipe.chunks = m
            out = pipe(sample_input)
            loss = loss_fn(out, move(target, pipe.output_device))
            torch.autograd.backward(loss)

        return step

    # The sweep's Dropout draws must not shift the training run's (fork_rng puts the
    # CPU and these devices' generators back).
    cuda = sorted({d.index or 0 for d in pipe.devices if d.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=cuda):
            return sweep_chunks(make_step, cands, rows, steps, warmup, _cuda_sync(pipe.devices))
    finally:
        pipe.chunks = original
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for k, v in pipe.module.named_buffers():
                if k in saved_buffers:
                    v.copy_(saved_buffers[k])

