"""``--log tensorboard``: the run's records as TensorBoard event files under ``--out``.

The values ``metrics.jsonl`` holds (still written), at the same moments:
:meth:`TensorBoardLog.write_epoch` turns the epoch's step losses, evaluation metrics,
throughput and peak memory into scalars once per epoch; nothing runs per step.
TensorBoard is an optional extra imported only when asked for; before the data loads,
:func:`check_available` and ``check_log_dir`` refuse a missing or broken install and
a read-only ``OUT/tensorboard``, each with the fix, and nothing is written.
"""

from __future__ import annotations

import importlib.util
import math
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchgpu.errors import ConfigError, UsageError, first_line
from torchgpu.train.out_dir import cannot_make_in
from torchgpu.train.outputs.files import TENSORBOARD_DIR as TB_DIR  # under --out
from torchgpu.train.outputs.files import EpochRecord


def check_available() -> None:
    """Raise ConfigError when the ``tensorboard`` package is missing or fails to import
    (a broken install: a protobuf mismatch, a missing dependency), naming the failure."""
    fix = ("pip install tensorboard (or 'torchgpu[tensorboard]'), or drop --log tensorboard "
           "to keep the default metrics.jsonl.")
    try:
        found = importlib.util.find_spec("tensorboard") is not None
    except (ImportError, ValueError):  # a half-imported or stubbed module
        found = False
    if not found:
        raise ConfigError(f"--log tensorboard needs the tensorboard package, which is not "
                          f"installed: {fix}")
    try:  # what TensorBoardLog imports; it pulls in tensorboard and its protobufs
        import torch.utils.tensorboard  # noqa: F401
    except Exception as error:  # a broken install fails with any type (TypeError...)
        raise ConfigError(
            f"--log tensorboard needs the tensorboard package, which is installed but fails "
            f"to import ({first_line(error)}): {fix}") from None


def check_log_dir(out: str) -> None:
    """Raise UsageError when ``OUT/tensorboard`` exists but nothing can be made in it (a
    read-only directory): the event files would fail only once the run has started. A
    missing one is made under ``--out``, whose own check covers it; a file in its place
    is refused by that check too."""
    directory = Path(out).expanduser() / TB_DIR
    try:
        if not stat.S_ISDIR(os.stat(directory).st_mode):
            return
    except OSError:
        return  # missing (or unreadable: the --out check or the write names it)
    reason = cannot_make_in(directory)
    if reason is not None:
        raise _unwritable(directory, reason)


def _unwritable(directory: Path, reason: str) -> UsageError:
    return UsageError(
        f"--log tensorboard writes its event files to {directory}, but nothing can be made "
        f"there ({reason}); nothing was written. Make that directory writable or remove it, "
        "pass another --out, or drop --log tensorboard (metrics.jsonl is written either way).")


class TensorBoardLog:
    """One run's event files in ``out_dir/tensorboard`` (rank 0 only).

    Scalars, by TensorBoard tag: ``train/loss`` per optimizer step; per epoch (at the
    epoch's last step) ``train/epoch_loss``, ``test/loss``, ``test/<name>`` for each of
    the task's metrics (``test/r2`` for housing, ``test/accuracy`` for lenet),
    ``throughput/samples_per_s`` and ``memory/peak_bytes``.
    """

    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = out_dir / TB_DIR
        try:  # checked before the run (check_log_dir); this is for a change since then
            self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))
        except OSError as error:
            raise _unwritable(self.log_dir, error.strerror or str(error)) from None

    def write_steps(self, steps: Sequence[tuple[int, int, float]]) -> None:
        """Step records ``(step, epoch, loss)``, as the loop keeps them."""
        for step, _epoch, loss in steps:
            self._writer.add_scalar("train/loss", loss, step)

    def write_epoch(self, steps: Sequence[tuple[int, int, float]], record: EpochRecord,
                    peak_memory_bytes: int | None) -> None:
        """The epoch's step losses and ``record``; flushed to disk."""
        self.write_steps(steps)
        values: dict[str, float | None] = {
            "train/epoch_loss": record.train_loss,
            "test/loss": record.test_loss,
            "throughput/samples_per_s": record.samples_per_s,
            "memory/peak_bytes": float(peak_memory_bytes) if peak_memory_bytes else None,
            **{f"test/{name}": value for name, value in record.metrics.items()},
        }
        for tag, value in values.items():
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                self._writer.add_scalar(tag, value, record.step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
