"""How long a run waited for its data: the share of training time spent blocked on the
next batch, per epoch and overall, and the warning when it starves the step.

The loop measures it (:attr:`torchgpu.train.loop.epoch.EpochTotals.data_wait_s`: host time in
``next()`` on the training batches, two clock reads per batch, no device sync); this
module keeps it per epoch, says when it passes :data:`WARN_SHARE` and writes it into
``summary.json``. Each process measures its own; rank 0's is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The share of an epoch's training time spent waiting for data that draws a warning.
WARN_SHARE = 0.10
#: ...once the epoch waited at least this long: a short run's start-up (workers
#: forking, the first batches) is no loader to fix.
WARN_MIN_SECONDS = 0.5


@dataclass
class DataWait:
    """The data wait of the epochs this process trained (a resumed run: from the resume
    on). ``workers``: the loader's resolved worker count, named in the warning; ``setting``:
    ``--num-workers`` as given (``"auto"`` or a number)."""

    workers: int
    setting: int | str
    # epoch, wait, training seconds, the first batch's wait
    epochs: list[tuple[int, float, float, float]] = field(default_factory=list)
    warned: bool = False

    def add(self, epoch: int, wait_s: float, seconds: float,
            first_s: float = 0.0) -> str | None:
        """Record epoch ``epoch``'s (0-based) wait, training time and the first batch's
        part of the wait; the warning line the first time an epoch's share passes
        :data:`WARN_SHARE` (once per run), else None.

        With workers, the first batch's wait is left out of the warning's share: it is
        the loader filling up (one worker loads a whole batch before the first arrives;
        short epochs are mostly that), which the warning's advice, more workers, cannot
        shorten. In-process loading (no workers) waits as long for every batch."""
        self.epochs.append((epoch, wait_s, seconds, first_s))
        steady = wait_s - first_s if self.workers > 0 else wait_s
        if self.warned or seconds <= 0 or steady < WARN_MIN_SECONDS:
            return None
        share = steady / seconds
        if share <= WARN_SHARE:
            return None
        self.warned = True
        given = ", chosen by auto" if isinstance(self.setting, str) else ""
        more = max(2, 2 * self.workers)
        after = " after the first batch" if self.workers > 0 else ""
        return (
            f"warning: epoch {epoch + 1} spent {share:.0%} of its training time waiting for "
            f"the next batch{after} (--num-workers {self.workers}{given}): the data "
            "loading does not keep up with the step. A __getitem__ that decodes, augments "
            f"or tokenises needs worker processes: pass e.g. --num-workers {more} "
            f"(fit(num_workers={more})), or make the loading cheaper; summary.json records "
            "the share per epoch (data_wait_share)."
        )

    def share(self) -> float | None:
        """The share over every recorded epoch (None before any training time)."""
        seconds = sum(s for _, _, s, _ in self.epochs)
        return sum(w for _, w, _, _ in self.epochs) / seconds if seconds > 0 else None

    def summary(self) -> dict[str, Any]:
        """``summary.json``'s entries: ``data_wait_share`` (overall) and
        ``data_wait_share_per_epoch`` (``[{"epoch": 1, "share": 0.03, "first_batch_s":
        0.41}, ...]``, 1-based; ``first_batch_s``: the seconds of the wait spent on the
        epoch's first batch)."""
        return {
            "data_wait_share": self.share(),
            "data_wait_share_per_epoch": [
                {"epoch": epoch + 1, "share": wait / seconds if seconds > 0 else None,
                 "first_batch_s": first}
                for epoch, wait, seconds, first in self.epochs],
        }
