"""What a suite returns: measurements, paired ratios, plot specs and notes (no I/O here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from torchgpu.bench.timer import Measurement, Ratio

PlotKind = Literal["bar", "line"]
Best = Literal["min", "max"]


@dataclass(frozen=True)
class Plot:
    """A figure the report draws from a suite's measurements.

    ``names`` are measurement names in drawing order; ``labels`` their tick labels (bars) and
    ``x`` their x positions (lines). ``value`` picks what is drawn: ``"median"`` with a
    [min..max] error bar, ``"mean"`` with a ±stdev error bar (the seed's figures), or
    ``"extra:KEY"`` for a plain per-measurement value such as bytes (no error bar).
    ``best`` marks the lowest (``"min"``) or highest (``"max"``) point.
    """

    filename: str
    kind: PlotKind
    title: str
    ylabel: str
    names: tuple[str, ...]
    labels: tuple[str, ...] = ()
    x: tuple[float, ...] = ()
    xlabel: str = ""
    value: str = "median"
    best: Best | None = None
    scale: float = 1.0  # multiply drawn values (e.g. 1/2**20 for MiB)

    def to_json(self) -> dict[str, Any]:
        return {
            "filename": self.filename,
            "kind": self.kind,
            "title": self.title,
            "ylabel": self.ylabel,
            "names": list(self.names),
            "labels": list(self.labels),
            "x": list(self.x),
            "xlabel": self.xlabel,
            "value": self.value,
            "best": self.best,
            "scale": self.scale,
        }


@dataclass(frozen=True)
class SuiteResult:
    """One suite's outcome. ``config`` records the sizes it ran with (batch, rounds...);
    ``notes`` say what was skipped and why, and what the numbers mean."""

    suite: str
    quick: bool
    devices: tuple[str, ...]
    measurements: tuple[Measurement, ...]
    ratios: tuple[Ratio, ...] = ()
    plots: tuple[Plot, ...] = ()
    notes: tuple[str, ...] = ()
    config: dict[str, Any] = field(default_factory=dict)

    def by_name(self) -> Mapping[str, Measurement]:
        return {m.name: m for m in self.measurements}


def plot_value(measurement: Measurement, value: str) -> tuple[float, float, float]:
    """(centre, lower error, upper error) of ``measurement`` as a :class:`Plot` draws it."""
    if value == "median":
        m = measurement
        return m.median, m.median - m.min, m.max - m.median
    if value == "mean":
        return measurement.mean, measurement.stdev, measurement.stdev
    if value.startswith("extra:"):
        return float(measurement.extra[value[len("extra:"):]]), 0.0, 0.0
    raise ValueError(f"plot value {value!r}: use 'median', 'mean' or 'extra:KEY'")


def best_index(values: list[float], best: Best | None) -> int | None:
    """Index of the best value (lowest for ``"min"``, highest for ``"max"``), or None."""
    if best is None or not values:
        return None
    pick = min if best == "min" else max
    return values.index(pick(values))
