"""The multi-process pipeline rows of the ``parallel`` suite: seed 002's ResNet run
with one process per stage on CPU (:class:`torchgpu.parallel.stages.StagePipeline`, GPipe
schedule on ``torch.distributed.pipelining`` over gloo), timed between barriers.

Unlike two stages in one process, two processes really can compute at the same time,
so on a machine with spare cores this is the CPU's analogue of the seed's two-GPU pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from torchgpu.bench.suites.resnet_run import ResNetRun, base_model, make_batches
from torchgpu.bench.workers import Stats, Step, WorkerGroup

FACTORY = "torchgpu.bench.suites.stages_run:build_stage"


def build_stage(rank: int, world_size: int, device: torch.device,
                spec: dict[str, Any]) -> tuple[Step, Stats]:
    """Worker side: this rank's ResNet-50 stage and one run's training step."""
    from torchgpu.parallel.stages import StagePipeline

    cfg = ResNetRun(**spec["run"])
    pipe = StagePipeline(base_model(cfg), device=device, loss_fn=nn.functional.mse_loss,
                         schedule="gpipe", chunks=int(spec["chunks"]))
    pipe.train(True)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.001)
    batches = make_batches(cfg)

    def step() -> None:
        for inputs, labels in batches:
            optimizer.zero_grad()
            pipe.step(inputs, labels)
            optimizer.step()

    def stats() -> dict[str, Any]:
        return {"rank": rank, "parameters": sum(p.numel() for p in pipe.parameters())}

    return step, stats


STAGES_NAME = "pipeline, 2 processes (gloo)"
STAGES_PROCESSES = 2


def stage_variant(cfg: ResNetRun, split: int, threads: int, stack: ExitStack, quick: bool
                  ) -> tuple[dict[str, Callable[[], float]], list[str]]:
    """Start 2 CPU stage processes of ``threads`` threads each (closed by ``stack``) and
    return their timed variant.

    The processes start in the background; the first call waits for them. The variant
    returns rank 0's seconds, so it can be interleaved with in-process variants by
    :func:`~torchgpu.bench.timer.measure_interleaved`.
    """
    chunks = cfg.chunks_for(split)
    spec = {"run": cfg.__dict__, "chunks": chunks}
    group = stack.enter_context(WorkerGroup(FACTORY, ["cpu"] * STAGES_PROCESSES, spec,
                                            threads=threads,
                                            timeout_s=120.0 if quick else 1800.0))
    notes = [
        f"'{STAGES_NAME}': torchgpu.parallel.stages.StagePipeline, one process per stage "
        f"x {threads} thread(s), GPipe schedule, {chunks} micro-batches (split {split}), "
        "timed between barriers inside the processes.",
    ]
    return {STAGES_NAME: group.run_once}, notes
