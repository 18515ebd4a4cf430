"""What one loader batch produced in the loop: :class:`BatchOutcome` (a leaf: the
micro-step, the window and the back-off all read it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchOutcome:
    """What one loader batch (or a replayed window ending with it) produced.

    ``value``: the batch's loss (NaN when not computed here). ``stepped``: the optimizer
    stepped after it. ``window``: ``(sum, count)`` of the finite losses of the whole
    window (this batch included) when it was replayed (the loop replaces its sums).
    ``dropped``: the window's gradients were non-finite on every rank (DDP) and no rank
    ran out of memory: the loop applies ``--on-nonfinite``.
    """

    value: float
    stepped: bool
    window: tuple[float, int] | None = None
    dropped: bool = False
