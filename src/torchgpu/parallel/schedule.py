"""Pure clock-cycle schedules for pipelines (no torch, no devices).

GPipe fill-drain: at clock ``k`` stage ``j`` works on micro-batch ``k - j``; a task
``(i, j)`` is micro-batch ``i`` on stage ``j``. With ``m`` micro-batches and ``n``
stages the forward takes ``m + n - 1`` clocks, of which each stage is idle
``n - 1`` (the bubble). The backward runs the same table in reverse.
"""

from __future__ import annotations

from collections.abc import Iterator

Task = tuple[int, int]  # (micro-batch index, stage index)


def clock_cycles(m: int, n: int) -> Iterator[list[Task]]:
    """Yield, for each clock, the tasks that may run at once in the forward pass.

    ``m`` micro-batches, ``n`` stages. Example ``m=3, n=2``::

        [(0, 0)]
        [(1, 0), (0, 1)]
        [(2, 0), (1, 1)]
        [(2, 1)]
    """
    if m < 1 or n < 1:
        raise ValueError(f"clock_cycles needs m >= 1 and n >= 1, got m={m}, n={n}")
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def backward_cycles(m: int, n: int) -> Iterator[list[Task]]:
    """The backward order of GPipe: the forward table reversed, stages reversed per clock."""
    for tasks in reversed(list(clock_cycles(m, n))):
        yield list(reversed(tasks))


def num_clocks(m: int, n: int) -> int:
    """Clocks of one forward pass: ``m + n - 1``."""
    return m + n - 1


def bubble_fraction(m: int, n: int) -> float:
    """Share of stage-clocks idle in fill-drain: ``(n - 1) / (m + n - 1)``."""
    return (n - 1) / (m + n - 1)


def ideal_speedup(m: int, n: int) -> float:
    """Speed-up of an ``n``-stage fill-drain pipeline over naive model parallelism
    (``m = 1``) with equal stages and free communication: ``n * m / (m + n - 1)``."""
    return n * m / (m + n - 1)
