"""``--chunks auto`` for the multi-process pipeline: :func:`choose_stage_chunks` runs the
split-size sweep (:func:`torchgpu.parallel.chunks.sweep_chunks`) on every rank alike and
rank 0's timings decide, leaving the weights, gradients and buffers as they were."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchgpu.errors import ConfigError
from torchgpu.parallel.chunks import ChunkChoice, sweep_chunks
from torchgpu.parallel.stage_schedules import check_schedule

if TYPE_CHECKING:
    from torchgpu.parallel.stages import StagePipeline


def choose_stage_chunks(
    pipe: StagePipeline,
    x: object,
    target: object,
    candidates: Sequence[int],
    steps: int = 3,
    warmup: int = 1,
) -> ChunkChoice:
    """The split-size sweep across ranks: every rank runs the same interleaved rounds;
    rank 0's timings decide and the choice is broadcast. Candidates the schedule cannot
    run (e.g. 1F1B below the stage count) are skipped; ``pipe.chunks`` is left unchanged.
    Gradients and buffers (BatchNorm statistics) are restored afterwards; the weights
    are never stepped."""
    ok = []
    for m in candidates:
        try:
            check_schedule(pipe.schedule_name, m, pipe.world_size, pipe.stages_per_rank)
            ok.append(m)
        except ConfigError:
            continue
    original = pipe.chunks
    buffers = [b for m in pipe.modules for b in m.buffers()]
    saved = [b.detach().clone() for b in buffers]
    params = list(pipe.parameters())
    saved_grads = [p.grad for p in params]

    def make_step(m: int) -> Callable[[], None]:
        def step() -> None:
            # From no gradient: a backward adds into an existing .grad in place, which
            # would change the caller's saved gradients.
            for p in params:
                p.grad = None
            pipe.chunks = m
            pipe.step(x, target)

        return step

    rows = int(x.shape[0]) if isinstance(x, torch.Tensor) else 0
    barrier: Callable[[], None] | None = (
        (lambda: dist.barrier(group=pipe.group)) if dist.is_initialized() else None
    )
    try:
        choice = sweep_chunks(make_step, ok, rows, steps, warmup, barrier)
    finally:
        pipe.chunks = original
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for buf, old in zip(buffers, saved, strict=True):
                buf.copy_(old)
    box: list[ChunkChoice] = [choice]  # rank 0's choice on every rank after the broadcast
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0, group=pipe.group)
    return box[0]

