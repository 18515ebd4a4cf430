"""What watches a run, as one object for the runner: profiler, TensorBoard, CUDA memory.

:meth:`Observers.start` builds only what the settings ask for (``--profile``,
``--log tensorboard``, ``--memory-snapshot``; on CUDA the out-of-memory observer, which
costs nothing until an OOM), so with the flags off the loop gets the same ``on_step``
hook and no per-step work. The runner calls :meth:`epoch` where it flushes
``metrics.jsonl``, ``close`` after the loop and ``report`` to fill the summary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchgpu.train.config import TrainConfig
from torchgpu.train.outputs.files import EpochRecord
from torchgpu.train.state import TrainState

if TYPE_CHECKING:
    from torchgpu.train.observe.memory_snapshot import MemoryRecorder
    from torchgpu.train.observe.profiler import StepProfiler
    from torchgpu.train.observe.tensorboard import TensorBoardLog
    from torchgpu.train.task import Task


@dataclass
class Observers:
    """The observers of one run (each None when not asked for, or not rank 0)."""

    device: torch.device
    profiler: StepProfiler | None = None
    tensorboard: TensorBoardLog | None = None
    memory: MemoryRecorder | None = None
    model: nn.Module | None = None  # the model trained, for the memory estimate's twin

    @classmethod
    def start(cls, config: TrainConfig, model: nn.Module, device: torch.device, rank: int,
              out_dir: Path | None, state: TrainState, steps_left: int) -> Observers:
        """Create and arm what ``config`` asks for. Profiles and event files are rank 0's
        (``out_dir`` set); memory snapshots are every rank's (files named by rank)."""
        watch = cls(device, model=model)
        if config.profile and out_dir is not None:
            from torchgpu.train.observe.profiler import StepProfiler, profile_window

            window = profile_window(config.profile, steps_left)
            watch.profiler = StepProfiler(model, device, out_dir, window)
            watch.profiler.begin(state)
        if config.log == "tensorboard" and out_dir is not None:
            from torchgpu.train.observe.tensorboard import TensorBoardLog

            watch.tensorboard = TensorBoardLog(out_dir)
        if device.type == "cuda" and config.out is not None:
            from torchgpu.parallel.data import unwrap
            from torchgpu.train.observe.memory_snapshot import MemoryRecorder

            watch.memory = MemoryRecorder(unwrap(model), Path(config.out), rank,
                                          config.memory_snapshot)
            watch.memory.arm()
        return watch

    def wrap(self, on_step: Callable[[TrainState], None] | None
             ) -> Callable[[TrainState], None] | None:
        """The loop's ``on_step``: unchanged unless profiling."""
        return self.profiler.wrap(on_step) if self.profiler is not None else on_step

    def steps(self, steps: Sequence[tuple[int, int, float]]) -> None:
        """Step records the run leaves with (a stop between epochs)."""
        if self.tensorboard is not None:
            self.tensorboard.write_steps(steps)

    def epoch(self, steps: Sequence[tuple[int, int, float]], record: EpochRecord) -> None:
        """An epoch ended: ``steps`` are its step records not yet flushed."""
        if self.tensorboard is not None:
            from torchgpu.train.outputs.report import peak_memory

            self.tensorboard.write_epoch(steps, record, peak_memory(self.device))

    def close(self, state: TrainState) -> None:
        """After the loop (also when it raised): finish the profile, close the event
        files, dump the memory history."""
        try:
            if self.profiler is not None:
                self.profiler.close(state)
            if self.tensorboard is not None:
                self.tensorboard.close()
        finally:
            if self.memory is not None:
                self.memory.finish()

    def report(self, summary: dict[str, Any], config: TrainConfig, planned: Any, task: Task,
               mode: str, world: int) -> None:
        """Add what was observed to ``summary`` (rank 0): ``profile``, ``memory_estimate``
        (and ``estimated_peak_bytes`` per device), ``memory_snapshots``, and ``files``."""
        from torchgpu.train.config_file import CONFIG_FILE
        from torchgpu.train.observe.memory_report import annotate_devices, memory_estimate

        files: dict[str, Any] = {}
        if config.out is not None:
            files["config"] = str(Path(config.out) / CONFIG_FILE)
        if self.profiler is not None:
            summary["profile"] = self.profiler.result
            if self.profiler.result is not None:
                files["profile"] = self.profiler.result["trace"]
        if self.tensorboard is not None:
            files["tensorboard"] = str(self.tensorboard.log_dir)
        if self.memory is not None and self.memory.files:
            summary["memory_snapshots"] = self.memory.summary()
        devices = [str(d["device"]) for d in summary["devices"]]
        entry = memory_estimate(config, planned, task, mode, world, devices[0],
                                model=self.model, devices=devices)
        summary["memory_estimate"] = entry
        annotate_devices(summary["devices"], entry)
        summary["files"] = {**summary.get("files", {}), **files}
