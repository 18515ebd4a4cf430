"""``--strategy pipeline --nproc N``: one pipeline stage per process.

The run's setup is :mod:`torchgpu.train.stage_strategy` (``own_run``: its own trainer
over ``torch.distributed.pipelining`` schedules, where one step is a forward and backward
of every micro-batch on every stage at once, its evaluation and its gathered final
state); its steps run in the engine's loop, :func:`torchgpu.train.loop.run_epoch`, like
every strategy's (non-finite handling, the stop decision, step records and progress
are the loop's). What it cannot do is declared here, with the
reason each user sees:

- resume: each process holds only its stages' weights and optimizer state; a checkpoint
  would have to gather them (and split them again on load), which is not written yet;
- precision: the schedules run the stages' forward outside autocast and without a
  GradScaler, so only fp32 is exact;
- OOM back-off and ``--batch-size auto``: a stage that runs out of memory leaves the
  others waiting mid-schedule in their send/receive, so no retry can be agreed on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchgpu.errors import UsageError
from torchgpu.train.split_flags import device_list, stages_per_rank
from torchgpu.train.strategies.base import Features, Strategy

if TYPE_CHECKING:
    from torchgpu.train.config import TrainConfig

_STRANDED = ("a stage that runs out of memory would leave the others waiting "
             "mid-schedule")


class StagePipeline(Strategy):
    """One stage (two with interleaved 1F1B) per process, its own loop."""

    name = "pipeline"
    label = "--strategy pipeline with several processes (--nproc)"
    help = "one pipeline stage per process"
    processes = "several"
    own_run = True
    features = Features(
        resume="each process holds only its stages, and their checkpoint is not written "
               "yet; run without them, or pipeline in one process with --devices",
        backoff=_STRANDED,
        auto_batch=f"{_STRANDED}; pass --batch-size B",
        precisions=("fp32",),
        precision_why="the stage schedules run without autocast or a GradScaler; pass "
                      "--precision fp32, or run the pipeline in one process (--devices ... "
                      "without --nproc)",
        flags=frozenset({"balance", "devices", "chunks", "schedule"}),
        estimate="pipeline")

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
