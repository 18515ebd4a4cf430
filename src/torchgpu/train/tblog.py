"""``--log tensorboard``: the run's records as TensorBoard event files under ``--out``.

The same values ``metrics.jsonl`` holds (which is still written), written at the same
moments: the loop keeps step losses in memory (:class:`~torchgpu.train.outputs.MetricsBuffer`)
and :meth:`TensorBoardLog.write_epoch` turns them into scalars once per epoch, with the
epoch's evaluation metrics, throughput and peak memory. Nothing runs per step.

TensorBoard is an optional extra (``pip install torchgpu[tensorboard]``): it is imported
only when a run asks for it, and :func:`check_available` refuses the flag with the fix
before anything is written. View with ``tensorboard --logdir OUT/tensorboard``.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchgpu.errors import ConfigError
from torchgpu.train.outputs import TENSORBOARD_DIR as TB_DIR  # under --out
from torchgpu.train.outputs import EpochRecord


def check_available() -> None:
    """Raise ConfigError when the ``tensorboard`` package is missing."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(
            "--log tensorboard needs the tensorboard package, which is not installed: "
            "pip install 'torchgpu[tensorboard]' (or tensorboard), or drop --log to keep "
            "the default metrics.jsonl."
        )


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
        self._writer: Any = SummaryWriter(log_dir=str(self.log_dir))

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
