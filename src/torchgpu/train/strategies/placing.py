"""Turning a TrainConfig into the pieces: device, strategy, wrapper.

Each function does one thing and raises a torchgpu error for bad input, so
:func:`torchgpu.train.assemble.assemble` can run all of them before ``--out`` is
created. What differs per strategy is asked of the strategy object
(:mod:`torchgpu.train.strategies`); the data and the model come from the run's plug-in
(``torchgpu.train.plugin``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from torchgpu.distributed import DistEnv
from torchgpu.train import strategies
from torchgpu.train.config import TrainConfig

if TYPE_CHECKING:
    from torchgpu.train.task import Task


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


def wrap_model(
    model: nn.Module,
    choice: strategies.Choice,
    config: TrainConfig,
    data: Task,
    device: torch.device,
) -> tuple[nn.Module, tuple[str, ...]]:
    """Activation checkpointing (if asked), then the strategy places and wraps the model,
    then ``--compile`` compiles what the strategy returned (DDP included).

    Returns the model to train and notes to show (e.g. dp falling back to one device).
    """
    notes: tuple[str, ...] = ()
    if config.activation_checkpointing:
        from torchgpu.memory.block_names import checkpoint_for_run

        notes = (checkpoint_for_run(model, config.activation_checkpointing),)
    wrapped, more = choice.strategy.wrap(model, config, data, device)
    notes += more
    if config.compile:
        skipped = choice.strategy.features.compile
        if skipped is not None:
            return wrapped, (*notes, f"note: --compile skipped under "
                                     f"{choice.strategy.described}: {skipped}.")
        from torchgpu.train.recipe.compiling import compile_for_run

        wrapped, note = compile_for_run(wrapped, config.compile_mode)
        notes += (note,)
    return wrapped, notes


def device_name(device: torch.device) -> str:
    """A person's name for ``device`` (GPU model, or the CPU's)."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        from torchgpu.devices import cpu_device_info

        return str(cpu_device_info().name)
    except Exception:  # naming the CPU is cosmetic; never fail a run on it
        return "cpu"
