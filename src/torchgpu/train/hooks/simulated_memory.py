"""Test-only simulated device memory for ``--batch-size auto``, as a run-hooks plug-in.

Testing the batch-size search without a GPU: :class:`SimulatedMemory` makes every probe
of the search above ``limit`` samples raise ``torch.OutOfMemoryError`` (before any work),
as a device of that size would. Processes read it once, when the run is assembled, from
``SIMULATE_ENV`` (``N`` for every rank or ``N0,N1,...`` per rank), through
:data:`torchgpu.train.hooks.run_hooks.ENV_PLUGINS`: the engine knows nothing of it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

import torch

from torchgpu.errors import UsageError
from torchgpu.train.hooks.run_hooks import RunHook

#: Test-only: a simulated memory limit in samples (``N`` or ``N0,N1,...`` per rank).
SIMULATE_ENV = "TORCHGPU_SIMULATE_MEMORY_LIMIT_SAMPLES"


class SimulatedMemory(RunHook):
    """Probes of more than ``limit`` samples run out of (simulated) memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def wrap_probe(self, try_step: Callable[[int], None]) -> Callable[[int], None]:
        limit = self.limit

        def probe(n: int) -> None:
            if n > limit:
                raise torch.OutOfMemoryError(
                    f"simulated memory limit: {n} samples do not fit, {limit} do "
                    f"({SIMULATE_ENV})")
            try_step(n)
        return probe


def simulated_limit(rank: int, environ: Mapping[str, str] | None = None) -> int | None:
    """The simulated limit for ``rank`` from :data:`SIMULATE_ENV` (None when unset).

    Raises UsageError for a value that is not positive integers.
    """
    text = (environ if environ is not None else os.environ).get(SIMULATE_ENV, "").strip()
    if not text:
        return None
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(
            f"{SIMULATE_ENV}={text!r} is not a sample count: give N, or N0,N1,... per rank "
            "(positive integers), or unset it."
        )
    return values[min(rank, len(values) - 1)]


def hooks_from_env(rank: int, environ: Mapping[str, str] | None = None) -> list[RunHook]:
    """The plug-in function of :data:`~torchgpu.train.hooks.run_hooks.ENV_PLUGINS`: the
    simulated memory of ``rank`` (none when unset)."""
    limit = simulated_limit(rank, environ)
    return [SimulatedMemory(limit)] if limit is not None else []
