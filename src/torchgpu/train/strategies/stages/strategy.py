"""``--strategy pipeline --nproc N``: one pipeline stage per process.

It runs through the driver and loop every strategy shares; its run (``stages.run.StageRun``,
from :meth:`StagePipeline.steps`) makes one step a forward and backward of every
micro-batch on every stage. Every rank walks the whole data order (rank 0 feeds the inputs,
the last rank the labels). Resume, a stop, ``--precision bf16`` and every observer work as
for the other strategies; fp16, OOM back-off and ``--batch-size auto`` are refused, with the
reasons users see in ``StagePipeline.features``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torchgpu.errors import UsageError
from torchgpu.train.strategies.base import Features, Strategy
from torchgpu.train.strategies.shard import Shard
from torchgpu.train.strategies.split import device_list, stages_per_rank

if TYPE_CHECKING:
    import torch  # only here (see strategies.base)
    from torch import nn

    from torchgpu.train.config import TrainConfig
    from torchgpu.train.strategies.run_steps import RunSteps, StepContext
    from torchgpu.train.task import Task

_STRANDED = ("a stage that runs out of memory raises inside the schedule while the other "
             "stages wait in their sends and receives for data that never comes, so no "
             "smaller retry can be agreed on")


class StagePipeline(Strategy):
    """One stage (two with interleaved 1F1B) per process, through the shared run driver."""

    name = "pipeline"
    label = "--strategy pipeline with several processes (--nproc)"
    help = "one pipeline stage per process"
    processes = "several"
    features = Features(
        backoff=_STRANDED,
        auto_batch=f"{_STRANDED}; pass --batch-size B",
        # fp16 would need every rank to agree on each step's found-inf and keep one scale,
        # which torch's GradScaler does not do across a pipeline's processes.
        precisions=("fp32", "bf16", "auto"),
        precision_why="fp16 needs a GradScaler, and each process's scaler would check "
                      "only its own stages' gradients for inf/NaN, so one stage could skip "
                      "a step (and lower its scale) that the others take, and the stages "
                      "would drift apart; use --precision bf16 (no scaler needed) or fp32",
        flags=frozenset({"balance", "devices", "chunks", "schedule"}),
        estimate="pipeline", compile="its stages run under the pipeline's own schedule, "
                                     "which torch.compile does not trace")

    def shard(self, rank: int, world: int) -> Shard:
        # Every stage steps every batch: each rank walks the one-process order.
        return Shard(0, 1)

    def wrap(self, model: nn.Module, config: TrainConfig, task: Task,
             device: torch.device) -> tuple[nn.Module, tuple[str, ...]]:
        return model, ()  # the stage trainer moves this rank's stages to its device

    def steps(self, ctx: StepContext) -> RunSteps:
        from torchgpu.train.strategies.stages.run import StageRun

        return StageRun(ctx)

    def check_task(self, task: Task, build_model: Callable[[], nn.Module]) -> None:
        from torchgpu.train.strategies.split import check_splittable

        check_splittable(build_model(), task, self.name)

    def check(self, config: TrainConfig, nproc: int) -> None:
        if config.devices is not None:
            devices = device_list(config.devices)
            if len(devices) != nproc:
                raise UsageError(
                    f"--devices {config.devices} names {len(devices)} devices for --nproc "
                    f"{nproc}: give one device per process ({nproc}), or drop --devices "
                    "(cuda:LOCAL_RANK on GPUs, else cpu).")
            gpus = [d for d in devices if d.startswith("cuda")]
            if len(set(gpus)) != len(gpus):
                raise UsageError(
                    f"--devices {config.devices} puts two of the --nproc {nproc} processes on "
                    "one GPU, which NCCL does not allow: give each process its own GPU "
                    "(cuda:0,cuda:1), or pipeline in one process (drop --nproc: --devices "
                    "cuda:0,cuda:0 works there).")
            if config.device != "auto":
                raise UsageError(
                    f"--device {config.device} and --devices {config.devices} were both "
                    "given: --devices places every stage; drop --device.")
        if config.nnodes > 1:
            raise UsageError(
                f"--nnodes {config.nnodes} is a data-parallel flag and --strategy pipeline "
                "runs on one node: drop --nnodes and name the devices with --devices "
                "cuda:0,cuda:1 (or --gpus 0,1 to use those GPUs).")
        if isinstance(config.chunks, int):
            schedule = config.schedule or "gpipe"
            stages = nproc * stages_per_rank(schedule)
            if schedule == "1f1b" and config.chunks < stages:
                raise UsageError(
                    f"--schedule 1f1b with --chunks {config.chunks} on {stages} stages: 1F1B "
                    f"needs at least as many micro-batches as stages; use --chunks {stages} "
                    "or more, or --schedule gpipe.")
            if schedule == "interleaved1f1b" and config.chunks % nproc:
                raise UsageError(
                    f"--schedule interleaved1f1b with --chunks {config.chunks}: the "
                    f"micro-batches must be a multiple of --nproc {nproc}, e.g. --chunks "
                    f"{max(nproc, config.chunks - config.chunks % nproc)}.")


STAGES = StagePipeline()
