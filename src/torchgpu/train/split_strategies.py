"""``torchgpu train --strategy model|pipeline`` in one process over several devices.

``model`` cuts the model's sequential view (``as_sequential()``: housing, LeNet,
ResNet-50) into one stage per ``--devices`` entry with
:func:`torchgpu.parallel.model.split_model`; ``pipeline`` does the same with a
:class:`~torchgpu.parallel.pipeline.Pipeline` that runs ``--chunks`` micro-batches
GPipe-style (``--chunks auto`` measures the split-size sweep for a few steps on the real
devices, prints the table and keeps the fastest M). Entries may repeat:
``cuda:0,cuda:0`` or ``cpu,cpu`` run the same code path on a machine with one GPU or none.

Inputs go to the first stage's device (the run's ``device``); the loop moves labels to
``model.output_device``. The saved model has the plain model's keys
(``SplitModel.state_dict``). Defaults: ``--devices`` = every visible GPU when there are
two or more (else the run is refused with the fix); ``--chunks`` = 4 per stage capped at
the batch size (GPipe's rule of thumb: with M >= 4K stages the bubble is small);
activation checkpointing (``--activation-checkpointing``) = ``except_last`` for the
pipeline and one checkpointed segment set per stage for ``model``.
"""

from __future__ import annotations

import sys
from collections.abc import Sized
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchgpu.devices.cuda_status import cuda_device_count
from torchgpu.distributed import DistEnv
from torchgpu.errors import UsageError
from torchgpu.train.split_flags import device_list, parse_balance, processes

if TYPE_CHECKING:
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.task import Task

CHUNKS_PER_STAGE = 4


def stage_devices(config: TrainConfig) -> list[torch.device]:
    """The stage devices of a one-process model/pipeline run (``--devices`` or every GPU).

    Raises DeviceSpecError / NoDeviceError (from :func:`~torchgpu.parallel.model.parse_devices`)
    for devices this machine lacks, UsageError when no list is given and fewer than two
    GPUs are visible.
    """
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

    Returns a SplitModel (``model``) or Pipeline (``pipeline``) over :func:`stage_devices`.
    BalanceError (exit 2) when ``--balance`` does not match the model's layers.
    """
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


def output_device(model: nn.Module) -> torch.device | None:
    """Where ``model``'s output lives if it places stages itself (labels go there)."""
    from torchgpu.parallel.model import SplitModel

    return model.output_device if isinstance(model, SplitModel) else None
