"""CPU pressure over a run (Linux PSI, ``/proc/pressure/cpu``).

:class:`PressureMonitor` reads the file before and after a run, so a report can say how
much of the wall time runnable tasks were stalled waiting for a CPU, and flag timings
taken on a contended machine (:func:`is_noisy`). ``None`` where the kernel has no PSI.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Clock = Callable[[], float]

PRESSURE_PATH = Path("/proc/pressure/cpu")


@dataclass(frozen=True)
class PressureLine:
    """One line of a PSI file: share of time (%) some/all tasks stalled, and total µs."""

    avg10: float
    avg60: float
    avg300: float
    total_us: int


def parse_pressure(text: str) -> dict[str, PressureLine]:
    """Parse PSI text (``some avg10=.. avg60=.. avg300=.. total=..`` lines) by line kind.

    Unknown or malformed lines are skipped; an empty dict means nothing usable.
    """
    parsed: dict[str, PressureLine] = {}
    for line in text.splitlines():
        kind, _, rest = line.strip().partition(" ")
        fields = dict(item.split("=", 1) for item in rest.split() if "=" in item)
        try:
            parsed[kind] = PressureLine(
                avg10=float(fields["avg10"]),
                avg60=float(fields["avg60"]),
                avg300=float(fields["avg300"]),
                total_us=int(fields["total"]),
            )
        except (KeyError, ValueError):
            continue
    return parsed


def read_pressure(path: Path = PRESSURE_PATH) -> dict[str, PressureLine] | None:
    """Read and parse a PSI file; ``None`` where the kernel does not provide it."""
    try:
        return parse_pressure(path.read_text()) or None
    except OSError:
        return None


@dataclass(frozen=True)
class CpuPressure:
    """CPU pressure over one run.

    ``stalled_us`` is the growth of the ``some`` total (µs in which at least one runnable
    task waited for a CPU) between start and end; ``stalled_fraction`` divides it by the
    run's wall time, clamped to [0, 1] (the two readings are not taken at exactly the
    clock's instants). ``avg10_start``/``avg10_end`` are the kernel's 10-second averages (%).
    """

    avg10_start: float
    avg10_end: float
    stalled_us: int
    wall_s: float
    stalled_fraction: float

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)

    @property
    def noisy(self) -> bool:
        """Whether the run was contended enough that its timings are unreliable."""
        return is_noisy(self.stalled_fraction)


# Above this share of wall time with runnable tasks waiting for a CPU, timings are flagged
# unreliable. A judgement call, not a measured boundary: a fifth of the run spent waiting
# for a CPU can move a ratio by more than the effects the suites look for (2-7%), and on
# the project's shared 2-core machine loaded runs stalled 80-100% with 6-8x swings.
NOISY_STALLED_FRACTION = 0.2


def is_noisy(stalled_fraction: float | None) -> bool:
    """True when ``stalled_fraction`` exceeds :data:`NOISY_STALLED_FRACTION`."""
    return stalled_fraction is not None and stalled_fraction > NOISY_STALLED_FRACTION


class PressureMonitor:
    """Brackets a run: ``start()`` then ``stop()`` -> :class:`CpuPressure` or ``None``."""

    def __init__(self, path: Path = PRESSURE_PATH, clock: Clock = time.perf_counter) -> None:
        self._path = path
        self._clock = clock
        self._start: dict[str, PressureLine] | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self._start = read_pressure(self._path)
        self._t0 = self._clock()

    def stop(self) -> CpuPressure | None:
        end = read_pressure(self._path)
        wall_s = self._clock() - self._t0
        if self._start is None or end is None or "some" not in end or "some" not in self._start:
            return None
        stalled = max(0, end["some"].total_us - self._start["some"].total_us)
        return CpuPressure(
            avg10_start=self._start["some"].avg10,
            avg10_end=end["some"].avg10,
            stalled_us=stalled,
            wall_s=wall_s,
            stalled_fraction=min(1.0, stalled / (wall_s * 1e6)) if wall_s > 0 else 0.0,
        )
