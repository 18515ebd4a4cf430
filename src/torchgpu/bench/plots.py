"""Draw a suite's :class:`~torchgpu.bench.result.Plot` specs as PNGs (matplotlib, Agg only).

Bars and lines get error bars only where there is a spread to show: a figure read once
(bytes from ``extra:``) is drawn without one, so nothing looks like an error bar that is
not. Log axes keep their ticks at the measured x values, labelled plainly (256, 1024...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torchgpu.bench.result import Plot, Series, best_index, plot_value
from torchgpu.bench.timer import Measurement


def _errors(points: Sequence[tuple[float, float, float]], scale: float) -> Any:
    """matplotlib's ``yerr`` for ``points``, or None when every error is zero."""
    lower = [p[1] * scale for p in points]
    upper = [p[2] * scale for p in points]
    if not any(lower) and not any(upper):
        return None
    return [lower, upper]


def _set_scale(ax: Any, axis: str, scale: str, ticks: Sequence[float] = ()) -> None:
    if scale == "linear":
        if ticks and axis == "x":
            ax.set_xticks(list(ticks))
            ax.set_xticklabels([f"{t:g}" for t in ticks])
        return
    from matplotlib.ticker import NullFormatter

    base = 2 if scale == "log2" else 10
    if axis == "x":
        ax.set_xscale("log", base=base)
        if ticks:
            ax.set_xticks(list(ticks))
            ax.set_xticklabels([f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_formatter(NullFormatter())
    else:
        ax.set_yscale("log", base=base)


def _draw_bars(ax: Any, plot: Plot, present: list[str],
               measurements: Mapping[str, Measurement]) -> None:
    points = [plot_value(measurements[n], plot.value) for n in present]
    centres = [p[0] * plot.scale for p in points]
    best = best_index(centres, plot.best)
    labels = [plot.labels[plot.names.index(n)] if plot.labels else n for n in present]
    xs = list(range(len(present)))
    colors = ["tab:green" if i == best else "tab:blue" for i in xs]
    ax.bar(xs, centres, yerr=_errors(points, plot.scale), align="center", alpha=0.6,
           ecolor="red", capsize=8, width=0.6, color=colors)
    ax.set_xticks(xs)
    slanted = len(present) > 3
    ax.set_xticklabels(labels, rotation=20 if slanted else 0,
                       ha="right" if slanted else "center")


def _draw_line(ax: Any, plot: Plot, series: Series, measurements: Mapping[str, Measurement],
               mark_best: bool) -> list[float]:
    """One line with its error bars (in the line's colour); returns the x values drawn."""
    present = [(n, x) for n, x in zip(series.names, series.x, strict=True) if n in measurements]
    if not present:
        return []
    points = [plot_value(measurements[n], plot.value) for n, _ in present]
    xs = [x for _, x in present]
    centres = [p[0] * plot.scale for p in points]
    ax.errorbar(xs, centres, yerr=_errors(points, plot.scale), fmt="o-", capsize=4,
                label=series.label or None)
    best = best_index(centres, plot.best) if mark_best else None
    if best is not None:
        ax.plot([xs[best]], [centres[best]], marker="*", markersize=16, color="tab:green",
                linestyle="none", label=f"best: {xs[best]:g}")
    return xs


def write_plot(plot: Plot, measurements: Mapping[str, Measurement], out: Path,
               subtitle: str = "") -> Path | None:
    """Draw ``plot`` to ``out/plot.filename``; returns the path, or None if nothing to draw.

    ``subtitle`` (devices, quick or full size) goes under the title.
    """
    if not [n for n in plot.all_names() if n in measurements and n != plot.reference]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = plot.kind == "bar"
    present = [n for n in plot.names if n in measurements]
    width = max(4.5, 1.1 * len(present) + 2) if bars else 7.0
    fig, ax = plt.subplots(figsize=(width, 4.5))
    try:
        if bars:
            _draw_bars(ax, plot, present, measurements)
        else:
            lines = plot.series or (Series("", plot.names, plot.x),)
            ticks: list[float] = []
            for series in lines:
                ticks += _draw_line(ax, plot, series, measurements, mark_best=len(lines) == 1)
            if plot.reference is not None and plot.reference in measurements:
                value = plot_value(measurements[plot.reference], plot.value)[0] * plot.scale
                ax.axhline(value, color="grey", linestyle="--",
                           label=f"{plot.reference}: {value:.3g}")
            _set_scale(ax, "x", plot.xscale, sorted(set(ticks)))
            ax.set_xlabel(plot.xlabel)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize="small")
        _set_scale(ax, "y", plot.yscale)
        ax.set_title(f"{plot.title}\n{subtitle}" if subtitle else plot.title,
                     fontsize="medium")
        ax.set_ylabel(plot.ylabel)
        ax.yaxis.grid(True)
        fig.tight_layout()
        path = out / plot.filename
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
