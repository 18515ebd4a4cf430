"""Step records on disk while an epoch runs: ``--log-every N`` (``log_every``).

:class:`StepLog` wraps the loop's ``on_step`` hook and, on rank 0, appends the step records
not written yet to metrics.jsonl every ``N`` optimizer steps, or without ``N`` every
``files.STEP_FLUSH_S`` seconds (one clock read per step), so a long epoch shows progress.
Each write is one flushed append: a crash never damages earlier lines. Under DDP only the
records up to the last agreed step are written (later ones hold this rank's own loss); the
rest follow at the next write or the epoch's end. A resume rewrites metrics.jsonl from its
checkpoint, so no line appears twice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from torchgpu.train.outputs import files as outputs
from torchgpu.train.outputs.files import MetricsBuffer
from torchgpu.train.state import TrainState

Hook = Callable[[TrainState], None]


class StepLog:
    """Writes ``buffer``'s step records to ``out_dir/metrics.jsonl`` inside an epoch
    (``out_dir`` None: not rank 0, nothing is written). ``every``: optimizer steps
    between writes (None: by time, ``period_s``). ``agreed``: the last step whose
    recorded loss is final (None: all are)."""

    def __init__(self, out_dir: Path | None, buffer: MetricsBuffer, every: int | None,
                 agreed: Callable[[], int | None], period_s: float | None = None) -> None:
        self.path = out_dir / outputs.METRICS_FILE if out_dir is not None else None
        self.buffer, self.every, self.agreed = buffer, every, agreed
        self.period_s = outputs.STEP_FLUSH_S if period_s is None else period_s
        self._last = time.monotonic()

    def wrap(self, on_step: Hook | None) -> Hook | None:
        """The loop's ``on_step``: ``on_step`` (checkpoints, schedule), then a write when
        one is due. Unchanged on ranks that write nothing."""
        if self.path is None:
            return on_step

        def hook(state: TrainState) -> None:
            if on_step is not None:
                on_step(state)
            if self.every is not None:
                if state.step % self.every == 0:
                    self.write()
            elif time.monotonic() - self._last >= self.period_s:
                self.write()

        return hook

    def write(self) -> None:
        """Append the records not written yet (up to the last agreed step)."""
        assert self.path is not None
        self._last = time.monotonic()
        outputs.append_lines(self.path, self.buffer.take_ready(self.agreed()), sync=False)
