"""``--strategy model|pipeline`` in one process: the model cut into stages over
``--devices`` (:mod:`torchgpu.train.split_strategies` builds them). With several
processes ``pipeline`` becomes one stage per process (:mod:`.stages`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torchgpu.errors import UsageError
from torchgpu.train.split_flags import device_list
from torchgpu.train.strategies.base import Features, Strategy
from torchgpu.train.strategies.stages import STAGES

if TYPE_CHECKING:
    # torch and the split's builders only here and inside methods (see strategies.base)
    import torch
    from torch import nn

    from torchgpu.distributed import DistEnv
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.task import Task

_CUTS = ("it cuts every batch into micro-batches over its stages itself, so a smaller "
         "retry is the --batch-size/--chunks you pass")
_NO_COMPILE = ("its stages live on several devices and run under its own schedule, which "
               "torch.compile does not trace")


class ModelSplit(Strategy):
    """Consecutive stages on ``--devices``, one batch at a time (``split_model``)."""

    name = "model"
    help = "the model's layers split over --devices, one process"
    processes = "one"
    features = Features(backoff=_CUTS, flags=frozenset({"balance", "devices"}),
                        estimate="split", compile=_NO_COMPILE)

    def one_process_message(self, world: int) -> str:
        return (f"--strategy {self.name} runs in one process over several devices, but "
                f"--nproc {world} was given: drop --nproc, or use --strategy pipeline "
                f"--nproc {world} for one stage per process.")

    def check(self, config: TrainConfig, nproc: int) -> None:
        if config.devices is not None:
            devices = device_list(config.devices)
            if nproc == 1 and len(devices) < 2:
                raise UsageError(
                    f"--strategy {config.strategy} --devices {config.devices} names one device: "
                    "a split needs at least two stages, e.g. --devices cuda:0,cuda:1, or "
                    "cuda:0,cuda:0 / cpu,cpu on a machine with one GPU or none.")
            if config.device != "auto":
                raise UsageError(
                    f"--device {config.device} and --devices {config.devices} were both given: "
                    "--devices places every stage; drop --device.")
        if config.nnodes > 1:
            raise UsageError(
                f"--nnodes {config.nnodes} is a data-parallel flag and --strategy "
                f"{config.strategy} runs on one node: drop --nnodes and name the devices with "
                "--devices cuda:0,cuda:1 (or --gpus 0,1 to use those GPUs).")

    def place(self, config: TrainConfig, env: DistEnv) -> torch.device | None:
        from torchgpu.train import split_strategies

        return split_strategies.split_device(config, env)

    def device_note(self, config: TrainConfig) -> str | None:
        return f"device: stages on {config.devices} (--devices)" if config.devices else None

    def wrap(self, model: nn.Module, config: TrainConfig, task: Task,
             device: torch.device) -> tuple[nn.Module, tuple[str, ...]]:
        from torchgpu.train import split_strategies

        return split_strategies.build_split_model(model, task, config, device, self.name), ()

    def output_device(self, model: nn.Module) -> torch.device | None:
        from torchgpu.train import split_strategies

        return split_strategies.output_device(model)


class Pipeline(ModelSplit):
    """GPipe micro-batches over the stages in one process; one stage per process with
    several (:data:`~torchgpu.train.strategies.stages.STAGES`)."""

    name = "pipeline"
    help = "GPipe micro-batches over --devices (one process) or one stage per process (--nproc)"
    processes = "any"
    features = Features(backoff=_CUTS, flags=frozenset({"balance", "devices", "chunks",
                                                        "schedule"}),
                        estimate="pipeline", compile=_NO_COMPILE)
    schedules: tuple[str, ...] = ("gpipe",)

    def for_processes(self, nproc: int) -> Strategy:
        return STAGES if nproc > 1 else self

    def check(self, config: TrainConfig, nproc: int) -> None:
        if config.schedule is not None and config.schedule not in self.schedules:
            raise UsageError(
                f"--schedule {config.schedule} needs several processes (--nproc N): one "
                "process pipelines with GPipe fill-drain. Add --nproc 2 or use --schedule gpipe.")
        super().check(config, nproc)


MODEL = ModelSplit()
PIPELINE = Pipeline()
