"""What a run reports: its result, epoch records, summary, peak memory, config file.

Shared by the runner and the multi-process stage pipeline, so both write the same
``summary.json`` and ``config.toml`` shapes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import resource
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchgpu.launch.stop_record import StopFlag
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_file import write_config as write_config_file
from torchgpu.train.outputs.evaluation import EvalResult
from torchgpu.train.outputs.files import EpochRecord
from torchgpu.train.state import TrainState
from torchgpu.version import versions

if TYPE_CHECKING:
    from torchgpu.train.task import Task


@dataclass(frozen=True)
class TrainResult:
    """What a run produced. ``model`` is the trained, unwrapped model (on its device)."""

    config: TrainConfig
    summary: dict[str, Any]
    state: TrainState
    epochs: tuple[EpochRecord, ...]
    model: nn.Module
    out_dir: Path | None  # None on ranks other than 0
    notes: tuple[str, ...] = field(default=())

    @property
    def final(self) -> EpochRecord | None:
        return self.epochs[-1] if self.epochs else None


def peak_memory(device: torch.device) -> int:  # bytes
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is KiB on Linux, bytes on macOS: the process's peak resident memory.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def write_config(out_dir: Path, config: TrainConfig, world: int, device: torch.device,
                 model: nn.Module | None = None,
                 fingerprints: Mapping[str, str] | None = None) -> None:
    """OUT/config.toml for the run: ``config`` as it ran, ``auto`` values resolved on
    ``device`` and with the wrapped ``model`` (a split model's chunks, balance, devices),
    and the sha256 ``fingerprints`` of its files."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    write_config_file(out_dir, config, world_size=world, local_world_size=local,
                      device=str(device), model=model, fingerprints=fingerprints)


def epoch_record(state: TrainState, result: EvalResult, samples: int, seconds: float,
                  world: int) -> EpochRecord:
    train_loss = state.epoch_loss_sum / state.epoch_loss_count if state.epoch_loss_count else (
        math.nan)
    return EpochRecord(
        epoch=state.epoch, step=state.step, train_loss=train_loss, test_loss=result.loss,
        samples_per_s=samples * world / seconds if seconds > 0 else math.nan, seconds=seconds,
        metrics=result.metrics,
    )


def summary_of(config: TrainConfig, data: Task, mode: str, world: int, state: TrainState,
             records: list[EpochRecord], peaks: list[Any], train_seconds: float,
             wall_seconds: float, stop: StopFlag, precision_mode: str,
             stopped_at: int | None = -1) -> dict[str, Any]:
    """The run's summary.json. ``data``: the run's Task (``final`` holds its metrics as
    ``test_<name>``, beside the losses; ``task`` its label). ``stopped_at``: the step the
    loop stopped at on the stop flag, None when it ran to the end (a signal after the
    last step stops nothing); -1 (the default): judge by the flag alone."""
    stopped = stop.is_set() if stopped_at == -1 else stopped_at is not None
    final = records[-1] if records else None
    assert config.batch_size is not None
    final_metrics: dict[str, Any] = {
        "train_loss": final.train_loss if final else None,
        "test_loss": final.test_loss if final else None,
    }
    for name in data.metrics:
        final_metrics[f"test_{name}"] = final.metrics.get(name) if final else None
    samples_all = state.samples * world
    return {
        "run": config.run_name,
        "task": data.kind,
        "strategy": mode,
        "world_size": world,
        "precision": precision_mode,
        "accumulate": config.accumulate,
        "activation_checkpointing": config.activation_checkpointing,
        "epochs": len(records),
        "steps": state.step,
        "skipped_steps": state.skipped_steps,
        "batch_size": config.batch_size,
        "global_batch": config.batch_size * world * config.accumulate,
        "lr": config.lr,
        "seed": config.seed,
        "final": final_metrics,
        "throughput_samples_per_s": samples_all / train_seconds if train_seconds else None,
        "train_seconds": train_seconds,
        "wall_seconds": wall_seconds,
        "stopped_early": stopped,
        "stop_reason": stop.signal_name if stopped else None,
        "stopped_at_step": state.step if stopped else None,
        # Under DDP, every rank's step at the agreed stop (all equal: one boundary).
        "stop_steps_by_rank": (stop.steps_by_rank or [state.step]) if stopped else None,
        "devices": [{"rank": r, "device": d, "name": n, "peak_memory_bytes": b}
                    for r, (d, n, b) in enumerate(peaks)],
        "versions": versions(),
        "config": {k: v for k, v in dataclasses.asdict(config).items()},
    }
