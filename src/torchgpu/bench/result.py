"""What a suite returns: measurements, paired ratios, plot specs and notes (no I/O here)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from torchgpu.bench.timer import Measurement, Ratio

PlotKind = Literal["bar", "line"]
Best = Literal["min", "max"]
Scale = Literal["linear", "log", "log2"]


@dataclass(frozen=True)
class Series:
    """One line of a multi-line plot: ``names`` (measurements) drawn at ``x``."""

    label: str
    names: tuple[str, ...]
    x: tuple[float, ...]

    def to_json(self) -> dict[str, object]:
        return {"label": self.label, "names": list(self.names), "x": list(self.x)}


@dataclass(frozen=True)
class Plot:
    """A figure the report draws from a suite's measurements.

    ``names`` are measurement names in drawing order; ``labels`` their tick labels (bars) and
    ``x`` their x positions (lines). ``value`` picks what is drawn: ``"median"`` with a
    [min..max] error bar, ``"mean"`` with a ±stdev error bar (the seed's figures), or
    ``"extra:KEY"`` for a plain per-measurement value such as bytes (no error bar).
    ``best`` marks the lowest (``"min"``) or highest (``"max"``) point.

    Lines: ``series`` draws several lines on one chart (then ``names``/``x`` are unused);
    ``xscale``/``yscale`` are ``"linear"``, ``"log"`` or ``"log2"`` (ticks stay at the
    measured x values). ``reference`` names a measurement drawn as a horizontal line
    (e.g. the single-device time behind a sweep).
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
    series: tuple[Series, ...] = ()
    xscale: Scale = "linear"
    yscale: Scale = "linear"
    reference: str | None = None

    def all_names(self) -> tuple[str, ...]:
        """Every measurement the plot draws (series, bars or line, and the reference)."""
        names = [n for s in self.series for n in s.names] or list(self.names)
        if self.reference is not None:
            names.append(self.reference)
        return tuple(names)

    def to_json(self) -> dict[str, object]:
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
            "series": [s.to_json() for s in self.series],
            "xscale": self.xscale,
            "yscale": self.yscale,
            "reference": self.reference,
        }


@dataclass(frozen=True)
class SuiteResult:
    """One suite's outcome. ``config`` records the sizes it ran with (batch, rounds...);
    ``notes`` say what was skipped and why, and what the numbers mean; ``verdicts`` are one
    line per seed claim the suite tests, e.g. "model parallel vs single device: 1.05x
    slower (seed: 1.07x slower)" (see :mod:`torchgpu.bench.verdict`)."""

    suite: str
    quick: bool
    devices: tuple[str, ...]
    measurements: tuple[Measurement, ...]
    ratios: tuple[Ratio, ...] = ()
    plots: tuple[Plot, ...] = ()
    notes: tuple[str, ...] = ()
    config: dict[str, object] = field(default_factory=dict)
    verdicts: tuple[str, ...] = ()

    def by_name(self) -> Mapping[str, Measurement]:
        return {m.name: m for m in self.measurements}


def plot_value(measurement: Measurement, value: str) -> tuple[float, float, float]:
    """(centre, lower error, upper error) of ``measurement`` as a :class:`Plot` draws it."""
    if value == "median":
        m = measurement
        return m.median, m.median - m.min, m.max - m.median
    if value == "mean":
        return measurement.mean, measurement.stdev, measurement.stdev
    if value.startswith("extra:"):  # a single figure (bytes...): no spread to draw
        return float(measurement.extra[value[len("extra:"):]]), 0.0, 0.0
    raise ValueError(f"plot value {value!r}: use 'median', 'mean' or 'extra:KEY'")


def best_index(values: list[float], best: Best | None) -> int | None:
    """Index of the best value (lowest for ``"min"``, highest for ``"max"``), or None."""
    if best is None or not values:
        return None
    pick = min if best == "min" else max
    return values.index(pick(values))
