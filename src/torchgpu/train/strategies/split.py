"""``--strategy model|pipeline`` in one process: the model cut into stages over ``--devices``.

Its flags (parsed pure, shared with the multi-process pipeline), the checks on the model and
the stage devices, and the strategy objects. ``model`` cuts the model's sequential view
(``as_sequential()``, an ``nn.Sequential`` or ``nn.ModuleList`` of blocks) into one stage
per ``--devices`` entry; ``pipeline`` also runs ``--chunks`` micro-batches GPipe-style
(``auto``: measured on the real devices). Entries may repeat (``cpu,cpu``), so one GPU or
none runs the same code path; the saved model has the plain model's keys. Defaults:
``--devices`` = every visible GPU when there are two or more; ``--chunks`` = 4 per stage,
capped at the batch size. Under ``--nproc`` the registry gives :class:`Pipeline` its
one-stage-per-process variant, so this module never imports ``stages``, which builds on it.
"""

from __future__ import annotations

import sys
from collections.abc import Sized
from typing import TYPE_CHECKING, Any, Literal

from torchgpu.errors import UsageError
from torchgpu.train.strategies.base import Features, Strategy, processes

if TYPE_CHECKING:
    # torch only here and inside functions (see strategies.base): the CLI builds its
    # parser from the strategies without importing torch.
    import torch
    from torch import nn

    from torchgpu.distributed import DistEnv
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.task import Task

SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved1f1b")
BALANCE_MODES: tuple[str, ...] = ("size", "time")
#: Stages each process holds under ``--schedule interleaved1f1b``.
INTERLEAVED_STAGES_PER_RANK = 2


CHUNKS_PER_STAGE = 4


def stage_devices(config: TrainConfig) -> list[torch.device]:
    """The stage devices of a one-process model/pipeline run (``--devices`` or every GPU).

    Raises DeviceSpecError / NoDeviceError (from :func:`~torchgpu.parallel.model.parse_devices`)
    for devices this machine lacks, UsageError when no list is given and fewer than two
    GPUs are visible.
    """
    import torch

    from torchgpu.devices.cuda_status import cuda_device_count
    from torchgpu.parallel.model import parse_devices

    if config.devices is not None:
        return parse_devices(device_list(config.devices))
    count = cuda_device_count() if torch.cuda.is_available() else 0
    if count >= 2:
        return parse_devices([f"cuda:{i}" for i in range(count)])
    raise UsageError(
        f"--strategy {config.strategy} needs --devices naming one device per stage: "
        f"{count} GPU(s) are visible, so name them, e.g. --devices cuda:0,cuda:0 on one GPU "
        "or --devices cpu,cpu on the CPU (the same code path, for testing)."
    )


def rank_device(config: TrainConfig, env: DistEnv) -> torch.device:
    """This process's device in a multi-process pipeline: ``--devices``' entry for the
    rank, else ``cuda:LOCAL_RANK`` on a GPU machine (``--device auto|cuda``), else cpu."""
    import torch

    from torchgpu.parallel.model import parse_devices

    if config.devices is not None:
        return parse_devices([device_list(config.devices)[env.rank]])[0]
    if config.device in ("auto", "cuda") and torch.cuda.is_available():
        return parse_devices([f"cuda:{env.local_rank}"])[0]
    from torchgpu.devices import get_device

    return get_device(config.device if config.device != "auto" else "cpu")


def split_device(config: TrainConfig, env: DistEnv) -> torch.device:
    """The run's device for model/pipeline (inputs go there)."""
    from torchgpu.errors import DeviceSpecError, NoDeviceError

    try:
        if processes(config) > 1 or env.world_size > 1:
            return rank_device(config, env)
        return stage_devices(config)[0]
    except NoDeviceError as error:  # a device the user named that is missing: exit 2
        raise DeviceSpecError(
            f"--devices {config.devices}: {error}"
        ) from None


def sample_batch(data: Task, rows: int) -> tuple[Any, Any]:
    """The first ``rows`` training samples ``(x, y)`` of a Task (balance and chunk
    measurements)."""
    train = data.train
    n = max(1, min(rows, len(train) if isinstance(train, Sized) else rows))
    x, y = data.sample(n)
    return x, y


def check_splittable(model: nn.Module, data: Task, strategy: str) -> None:
    """Refuse (UsageError, exit 2) a model or data that cannot be cut into stages:
    stages need an ``nn.Sequential``, a model with ``as_sequential()`` or an
    ``nn.ModuleList`` of blocks, fed one tensor per batch."""
    from torch import nn

    if getattr(data, "dict_batches", False):
        raise UsageError(
            f"--strategy {strategy} passes one tensor from stage to stage, but the data yields "
            "dict batches (model(**batch)): use --strategy single, dp, ddp or fsdp for this "
            "model, or give the data as (input_tensor, target) pairs and the model as an "
            "nn.Sequential."
        )
    if isinstance(model, nn.Sequential | nn.ModuleList) or callable(
            getattr(model, "as_sequential", None)):
        return
    raise UsageError(
        f"--strategy {strategy} cuts the model into consecutive stages, but "
        f"{type(model).__name__} is not an nn.Sequential, has no as_sequential() method and "
        "is not an nn.ModuleList of blocks (a Python list is not a module): return an "
        "nn.Sequential or nn.ModuleList from the model factory (or add as_sequential() "
        "returning an nn.Sequential that shares the modules), or use --strategy single, "
        "dp, ddp or fsdp."
    )


def default_chunks(batch_size: int, stages: int) -> int:
    """``CHUNKS_PER_STAGE`` micro-batches per stage, at most one per sample."""
    return max(1, min(batch_size, CHUNKS_PER_STAGE * stages))


def build_split_model(
    model: nn.Module, data: Task, config: TrainConfig, device: torch.device,
    kind: str | None = None,
) -> nn.Module:
    """The model of ``--strategy model`` or ``pipeline`` in one process (``kind``;
    default ``config.strategy``), as :mod:`torchgpu.train.strategies.split` wraps it.
    ``data``: the run's :class:`~torchgpu.train.task.Task` (samples measure the stages).

    Returns a SplitModel (``model``) or Pipeline (``pipeline``) over ``stage_devices``.
    BalanceError (exit 2) when ``--balance`` does not match the model's layers.
    """
    from torch import nn

    from torchgpu.parallel.pipeline import build_pipeline_model
    kind = kind or config.strategy
    check_splittable(model, data, kind)
    if isinstance(model, nn.ModuleList):
        model = nn.Sequential(*model)
    devices = stage_devices(config)
    balance = parse_balance(config.balance) if config.balance is not None else None
    batch = int(config.batch_size or 1)
    x, y = sample_batch(data, batch)
    checkpoint = "except_last" if config.activation_checkpointing else "never"
    if kind == "model":
        split = build_pipeline_model(model, "model", devices, balance=balance, sample=x)
        if config.activation_checkpointing:
            from torchgpu.memory.activation_checkpointing import apply_activation_checkpointing

            for stage in split.partitions:
                if len(stage) > 1:
                    apply_activation_checkpointing(stage)
        return split
    chunks: int | str = (config.chunks if config.chunks is not None
                         else default_chunks(batch, len(devices)))
    pipe = build_pipeline_model(
        model, "pipeline", devices, balance=balance,
        chunks="auto" if chunks == "auto" else int(chunks), checkpoint=checkpoint,
        sample=x, sample_target=y, loss_fn=data.loss,
    )
    choice = getattr(pipe, "chunk_choice", None)
    if choice is not None:
        print(f"pipeline: split-size sweep on {', '.join(str(d) for d in pipe.devices)} "
              f"(batch {x.shape[0]}), chose --chunks {choice.chunks}:\n{choice.format()}",
              file=sys.stderr)
    return pipe


def device_list(spec: str) -> list[str]:
    """``"cuda:0, cuda:1"`` -> ``["cuda:0", "cuda:1"]``; UsageError for an empty item."""
    items = [item.strip() for item in spec.split(",")]
    if not spec.strip() or any(not item for item in items):
        raise UsageError(
            f"--devices {spec!r} is not a device list: give comma-separated devices such as "
            "cuda:0,cuda:1, cuda:0,cuda:0 or cpu,cpu."
        )
    return items


def parse_balance(spec: str) -> list[int] | Literal["size", "time"]:
    """``--balance`` as a list of layer counts, or ``"size"``/``"time"``."""
    text = spec.strip().lower()
    if text == "size":
        return "size"
    if text == "time":
        return "time"
    try:
        counts = [int(item) for item in text.split(",")]
    except ValueError:
        raise UsageError(
            f"--balance {spec!r} is not understood: give layer counts per stage such as "
            "3,2, or size (parameters + activations) or time (profiled)."
        ) from None
    if any(c < 1 for c in counts):
        raise UsageError(
            f"--balance {spec!r} has a stage with {min(counts)} layers: every stage needs at "
            "least one layer, e.g. --balance 3,2."
        )
    return counts


def stages_per_rank(schedule: str | None) -> int:
    """Stages each process holds for ``schedule`` (2 for interleaved 1F1B, else 1)."""
    return INTERLEAVED_STAGES_PER_RANK if schedule == "interleaved1f1b" else 1


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
        return split_device(config, env)

    def device_note(self, config: TrainConfig) -> str | None:
        return f"device: stages on {config.devices} (--devices)" if config.devices else None

    def wrap(self, model: nn.Module, config: TrainConfig, task: Task,
             device: torch.device) -> tuple[nn.Module, tuple[str, ...]]:
        return build_split_model(model, task, config, device, self.name), ()

    def output_device(self, model: nn.Module) -> torch.device | None:
        from torchgpu.parallel.model import placed_output_device

        return placed_output_device(model)


class Pipeline(ModelSplit):
    """GPipe micro-batches over the stages in one process; with several processes, the
    ``staged`` strategy the registry gives it (one stage per process,
    :data:`~torchgpu.train.strategies.stages.strategy.STAGES`)."""

    name = "pipeline"
    help = "GPipe micro-batches over --devices (one process) or one stage per process (--nproc)"
    processes = "any"
    features = Features(backoff=_CUTS, flags=frozenset({"balance", "devices", "chunks",
                                                        "schedule"}),
                        estimate="pipeline", compile=_NO_COMPILE)
    schedules: tuple[str, ...] = ("gpipe",)

    def __init__(self, staged: Strategy) -> None:
        self.staged = staged

    def for_processes(self, nproc: int) -> Strategy:
        return self.staged if nproc > 1 else self

    def check(self, config: TrainConfig, nproc: int) -> None:
        if config.schedule is not None and config.schedule not in self.schedules:
            raise UsageError(
                f"--schedule {config.schedule} needs several processes (--nproc N): one "
                "process pipelines with GPipe fill-drain. Add --nproc 2 or use --schedule gpipe.")
        super().check(config, nproc)


MODEL = ModelSplit()
