"""The run's history as ``metrics.jsonl`` holds it, to and from a checkpoint: the lines of
a run at a saved position (written again on resume, so the file ends as the
uninterrupted run's) and the epoch records read back from the file."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from torchgpu.train.checkpoints.saved_position import epoch_record
from torchgpu.train.outputs.files import EpochRecord, MetricsBuffer
from torchgpu.train.state import TrainState


def history_lines(state: TrainState, records: Iterable[EpochRecord]) -> list[str]:
    """The metrics.jsonl lines of a run at ``state``: each finished epoch's step lines and
    epoch line, then the unfinished epoch's step lines (same format as the loop writes)."""
    buffer = MetricsBuffer(lrs=state.step_lrs)
    lines: list[str] = []
    done = 0
    for record in records:
        buffer.steps = [(s, record.epoch, state.step_losses[s - 1])
                        for s in range(done + 1, record.step + 1)]
        lines += buffer.take_lines()
        lines.append(json.dumps(
            {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in record.as_dict().items()}))
        done = record.step
    buffer.steps = [(s, state.epoch, state.step_losses[s - 1])
                    for s in range(done + 1, state.step + 1)]
    return lines + buffer.take_lines()


def epoch_records(path: Path) -> list[EpochRecord]:
    """The epoch records of a run's metrics.jsonl at ``path`` (unreadable lines and a
    missing file give none)."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            data = json.loads(line)
            if isinstance(data, dict) and data.get("kind") == "epoch":
                records.append(epoch_record(data))
        except (ValueError, TypeError):
            continue
    return records
