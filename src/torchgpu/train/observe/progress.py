"""What a person sees while training: a rich progress bar, or one line per epoch.

:func:`make_progress` picks: rich bar on a TTY on rank 0; a plain one-line-per-epoch
log when stdout is not a TTY (CI, pipes) or ``mode="plain"``; nothing on other ranks
or with ``mode="off"``. The loop calls :meth:`update` at most ~10 times a second.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO

from torchgpu.train.outputs.files import EpochRecord
from torchgpu.train.state import TrainState

if TYPE_CHECKING:
    import torch

MemoryReader = Callable[[], str]  # "" when there is nothing to show
#: How the epoch line shows a metric: its label and format (others: ``name 0.1234``).
SHOWN: dict[str, tuple[str, str]] = {"r2": ("R²", ".3f"), "accuracy": ("acc", ".3f")}


def process_rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm), else its peak
    (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def read_process_rss() -> str:
    """The memory column on a CPU: the process's resident memory (RSS)."""
    return f"RSS {process_rss_bytes() / 2**30:.2f} GiB"


def memory_reader(device: torch.device) -> Any:
    """The progress display's memory column: the device's peak on CUDA, else the
    process's resident memory."""
    import torch

    if device.type != "cuda":  # the CPU's memory is the process's (model, data, activations)
        return read_process_rss

    def read() -> str:
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB"

    return read


class NullProgress:
    """Shows nothing (ranks other than 0, ``--progress off``, ``--json``)."""

    def start(self, epochs: int, steps_per_epoch: int, first_epoch: int = 0) -> None:
        pass

    def update(self, state: TrainState, loss: float, samples_per_s: float) -> None:
        pass

    def end_epoch(self, record: EpochRecord, epochs: int,
                  data_wait: float | None = None) -> None:
        pass

    def note(self, message: str) -> None:
        pass

    def close(self) -> None:
        pass


def format_epoch(record: EpochRecord, epochs: int, memory: str = "",
                 data_wait: float | None = None) -> str:
    """``epoch 3/40  step 78  train 0.1234  test 0.2345  R² 0.81  1234 samples/s``, then
    ``data wait 3%`` (the share of the epoch's training time spent waiting for batches:
    :mod:`torchgpu.train.observe.data_wait`) when given, and the memory."""
    parts = [
        f"epoch {record.epoch + 1}/{epochs}",
        f"step {record.step}",
        f"train {record.train_loss:.4g}",
        f"test {record.test_loss:.4g}",
    ]
    for name, value in record.metrics.items():
        label, form = SHOWN.get(name, (name, ".4g"))
        parts.append(f"{label} {value:{form}}")
    parts.append(f"{record.samples_per_s:,.0f} samples/s")
    if data_wait is not None:
        parts.append(f"data wait {data_wait:.0%}")
    if memory:
        parts.append(memory)
    return "  ".join(parts)


class PlainProgress(NullProgress):
    """One line per epoch on ``stream`` (stdout by default)."""

    def __init__(self, stream: TextIO | None = None, memory: MemoryReader | None = None) -> None:
        self._stream = stream
        self._memory = memory

    def _out(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def end_epoch(self, record: EpochRecord, epochs: int,
                  data_wait: float | None = None) -> None:
        memory = self._memory() if self._memory is not None else ""
        print(format_epoch(record, epochs, memory, data_wait), file=self._out(), flush=True)

    def note(self, message: str) -> None:
        print(message, file=self._out(), flush=True)


class RichProgress(PlainProgress):
    """A rich bar per epoch: epoch, step, loss, samples/s, device memory."""

    def __init__(self, memory: MemoryReader | None = None) -> None:
        super().__init__(None, memory)
        self._progress: Any = None
        self._task: Any = None

    def start(self, epochs: int, steps_per_epoch: int, first_epoch: int = 0) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("[bold]epoch {task.fields[epoch]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[speed]}"),
            TextColumn("{task.fields[memory]}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._progress.start()
        self._task = self._progress.add_task(
            "train",
            total=epochs * steps_per_epoch,
            completed=first_epoch * steps_per_epoch,
            epoch=f"{first_epoch + 1}/{epochs}",
            loss="-",
            speed="",
            memory="",
        )
        self._epochs = epochs
        self._per_epoch = steps_per_epoch

    def update(self, state: TrainState, loss: float, samples_per_s: float) -> None:
        if self._progress is None:
            return
        self._progress.update(
            self._task,
            completed=state.epoch * self._per_epoch + state.batch_in_epoch,
            epoch=f"{state.epoch + 1}/{self._epochs}",
            loss=f"{loss:.4g}",
            speed=f"{samples_per_s:,.0f} samples/s",
            memory=self._memory() if self._memory is not None else "",
        )

    def end_epoch(self, record: EpochRecord, epochs: int,
                  data_wait: float | None = None) -> None:
        if self._progress is None:
            return super().end_epoch(record, epochs, data_wait)
        memory = self._memory() if self._memory is not None else ""
        # The loop's updates are throttled: the last one may predate the epoch's end.
        self._progress.update(
            self._task,
            completed=(record.epoch + 1) * self._per_epoch,
            epoch=f"{min(record.epoch + 2, epochs)}/{epochs}",
            loss=f"{record.train_loss:.4g}",
            speed=f"{record.samples_per_s:,.0f} samples/s",
            memory=memory,
        )
        self._progress.console.print(format_epoch(record, epochs, memory, data_wait))

    def note(self, message: str) -> None:
        if self._progress is None:
            return super().note(message)
        self._progress.console.print(message)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def make_progress(
    mode: str, *, is_main: bool, memory: MemoryReader | None = None, stream: TextIO | None = None
) -> NullProgress:
    """``mode``: auto|rich|plain|off. Not rank 0 -> nothing; auto -> rich only on a TTY."""
    if not is_main or mode == "off":
        return NullProgress()
    out = stream if stream is not None else sys.stdout
    tty = bool(getattr(out, "isatty", lambda: False)())
    if mode == "rich" or (mode == "auto" and tty):
        return RichProgress(memory)
    return PlainProgress(stream, memory)
