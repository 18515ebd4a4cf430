"""Turning a TrainConfig into the pieces: device, strategy, data, model, wrapper.

Each function does one thing and raises a torchgpu error for bad input, so
:func:`torchgpu.train.assemble.assemble` can run all of them before ``--out`` is
created. What differs per strategy is asked of the strategy object
(:mod:`torchgpu.train.strategies`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from torchgpu.data import ExampleData
from torchgpu.distributed import DistEnv
from torchgpu.errors import DataError
from torchgpu.train import strategies
from torchgpu.train.config import TrainConfig


def choose_device(config: TrainConfig, env: DistEnv) -> torch.device:
    """The device this process trains on; under torchrun a bare ``cuda`` is cuda:LOCAL_RANK.

    Raises DeviceSpecError (exit 2) for a named device this machine lacks; NoDeviceError
    (exit 3) only from ``auto`` (e.g. TORCHGPU_DEVICE naming a missing device).
    """
    from torchgpu.devices import get_device
    from torchgpu.errors import DeviceSpecError, NoDeviceError

    if config.strategy != strategies.AUTO:  # model/pipeline: --devices places the stages
        placed = strategies.get(config.strategy).place(config, env)
        if placed is not None:
            return placed
    try:
        device = get_device(config.device)
    except NoDeviceError as error:
        if config.device == "auto":
            raise
        # A device the user named that this machine lacks is bad input (exit 2) here.
        raise DeviceSpecError(
            f"--device {config.device}: {error}; or train on this machine's CPU with "
            "--device cpu"
        ) from None
    if env.is_distributed and device.type == "cuda" and config.device in ("auto", "cuda"):
        device = get_device(f"cuda:{env.local_rank}")
    return device


def device_note(config: TrainConfig, device: torch.device) -> str:
    """One line for the console: the device chosen and why (never starts CUDA)."""
    import os

    placed = (strategies.get(config.strategy).device_note(config)
              if config.strategy != strategies.AUTO else None)
    if placed is not None:
        return placed
    if config.device != "auto":
        return f"device: {device} (--device {config.device})"
    if os.environ.get("TORCHGPU_DEVICE"):
        return f"device: {device} (TORCHGPU_DEVICE={os.environ['TORCHGPU_DEVICE']})"
    if device.type == "cpu":
        from torchgpu.devices import cuda_unavailable_reason

        why = cuda_unavailable_reason()
        return f"device: cpu (no usable CUDA GPU: {why})" if why else "device: cpu"
    return f"device: {device} (auto: the first visible GPU, or LOCAL_RANK under torchrun)"


def choose_strategy(config: TrainConfig, env: DistEnv, device: torch.device
                    ) -> strategies.Choice:
    """The strategy that runs for ``--strategy`` with this run's processes (see
    :func:`torchgpu.train.strategies.choose`): ``auto`` is ddp with several processes,
    else single; a one-process strategy with several processes is refused; ddp/fsdp in
    one process train as single with a note; ``pipeline`` with several processes is one
    stage per process."""
    return strategies.choose(config.strategy, env.world_size, device)


def precision_notes(config: TrainConfig, device: torch.device) -> tuple[str, ...]:
    """A warning for ``--precision bf16`` asked for on a CPU (allowed, but usually far
    slower than fp32 there: ``auto`` never picks it on a CPU)."""
    if config.precision == "bf16" and device.type == "cpu":
        return ("warning: --precision bf16 on the CPU: bf16 autocast is usually far slower "
                "than fp32 on CPUs without native bf16 units (measured ~100x slower on one "
                "such CPU); use --precision fp32 (or auto) unless you are testing numerics.",)
    return ()


def load_data(config: TrainConfig) -> ExampleData:
    """The example's data, or the CSV file's (DataError for a bad file, exit 2).

    ``config.batch_size`` (resolved; None with ``--batch-size auto``): a CSV whose
    train split holds fewer rows than one batch is refused here.
    """
    from torchgpu.data import csv_data, example_data

    if config.data is not None:
        assert config.target is not None
        handed = _handed_off(config)
        if handed is not None:
            return handed
        return csv_data(config.data, config.target, seed=config.seed,
                        batch_size=config.batch_size)
    name = config.example or "housing"
    data = example_data(name, seed=config.seed, size=config.data_size)
    n_train, n_test = len(data.train), len(data.test)
    if config.batch_size is not None and n_train < config.batch_size:
        # The loader would silently make one smaller batch: refuse, as for a CSV table.
        more = " or a larger --data-size" if config.data_size is not None else ""
        raise DataError(
            f"example {name} has {n_train + n_test} samples, so the train split holds "
            f"{n_train} (test {n_test}), fewer than one batch of {config.batch_size}: use "
            f"--batch-size {n_train} or less{more}"
        )
    return data


#: The launcher's hand-off to its workers: a file holding the data it already loaded.
HANDOFF_ENV = "TORCHGPU_DATA_HANDOFF"


def _source_key(config: TrainConfig) -> dict[str, Any]:
    """What the handed-off data was made from: the CSV file as it was, target, seed."""
    assert config.data is not None
    stat = os.stat(config.data)
    return {"path": os.path.abspath(config.data), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "target": config.target, "seed": config.seed}


def _handed_off(config: TrainConfig) -> ExampleData | None:
    """The data the launcher wrote for this run (see :func:`data_handoff`), or None when
    there is none, or it was made from another file, version, target or seed."""
    from torchgpu.data.handoff import load_example

    path = os.environ.get(HANDOFF_ENV)
    if not path or config.data is None or not os.path.isfile(config.data):
        return None
    return load_example(path, expected_key=_source_key(config))


@contextlib.contextmanager
def data_handoff(config: TrainConfig, data: ExampleData | None) -> Iterator[None]:
    """While relaunching under torchrun: the launcher's CSV data, already parsed, split
    and standardised, written once to a temporary file that every worker on this node
    loads instead of parsing the CSV again (``HANDOFF_ENV`` names it; the workers
    inherit the variable). Removed, and the variable restored, on exit. Built-in
    examples are generated in milliseconds and need none."""
    if config.data is None or config.target is None or data is None:
        yield
        return
    from torchgpu.data.handoff import save_example

    previous = os.environ.get(HANDOFF_ENV)
    with tempfile.TemporaryDirectory(prefix="torchgpu-data-") as tmp:
        path = os.path.join(tmp, "data.npz")
        save_example(data, path, key=_source_key(config))
        del data  # the caller drops its copy too while the workers run
        os.environ[HANDOFF_ENV] = path
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(HANDOFF_ENV, None)
            else:
                os.environ[HANDOFF_ENV] = previous


def build_model(config: TrainConfig, data: ExampleData) -> nn.Module:
    """The model for ``data``, initialised from ``config.seed`` (identical on every rank)."""
    from torchgpu.models import build_model as build

    torch.manual_seed(config.seed)
    if config.data is not None or config.example == "housing":
        return build("housing", in_dim=data.input_shape[0], out_dim=data.num_outputs)
    if config.example == "lenet":
        return build("lenet", num_classes=data.num_outputs)
    return build("resnet50", num_classes=data.num_outputs)


def loss_function(task: str) -> Callable[[Tensor, Tensor], Tensor]:
    """MSE for regression (targets already (N, 1)), cross-entropy for classification."""
    return nn.MSELoss() if task == "regression" else nn.CrossEntropyLoss()


def wrap_model(
    model: nn.Module,
    choice: strategies.Choice,
    config: TrainConfig,
    data: Any,  # the run's Task
    device: torch.device,
) -> tuple[nn.Module, tuple[str, ...]]:
    """Activation checkpointing (if asked), then the strategy places and wraps the model.

    Returns the model to train and notes to show (e.g. dp falling back to one device).
    """
    notes: tuple[str, ...] = ()
    if config.activation_checkpointing:
        from torchgpu.memory.activation_checkpointing import (
            apply_activation_checkpointing,
            checkpointing_report,
        )

        model = apply_activation_checkpointing(model)
        notes = (checkpointing_report(model).describe(),)
    wrapped, more = choice.strategy.wrap(model, config, data, device)
    return wrapped, notes + more


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """Adam over the trainable parameters (the seeds' optimizer)."""
    return torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)


def device_name(device: torch.device) -> str:
    """A person's name for ``device`` (GPU model, or the CPU's)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        from torchgpu.devices import cpu_device_info

        return str(cpu_device_info().name)
    except Exception:  # naming the CPU is cosmetic; never fail a run on it
        return "cpu"
