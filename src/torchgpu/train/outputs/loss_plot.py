"""The loss plot (``loss.png``): train and test loss per epoch, drawn with Pillow.

Pillow draws this one chart in ~30 ms; matplotlib's ~0.45 s of CPU per process was a tenth
of a 200-epoch ``make demo``. Axes, a grid, nice ticks (a log scale when every loss is
positive and there are several epochs), two lines with markers, a legend and a title; a
non-finite loss (no held-out data, a skipped epoch) leaves a gap in its line. When the
learning rate changed during the run, a second panel draws it per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

WIDTH, HEIGHT = 640, 400  # pixels
LEFT, RIGHT, TOP, BOTTOM = 72, 20, 36, 48  # margins around the plotting area
COLORS = {"train": (31, 119, 180), "test": (255, 127, 14)}  # matplotlib's first two
LR_COLOR = (44, 160, 44)  # matplotlib's third
LR_HEIGHT = 170  # pixels of the learning-rate panel under the loss chart
GRID = (226, 226, 226)
INK = (40, 40, 40)


def render(path: Path | IO[bytes], xs: Sequence[int], train: Sequence[float],
           test: Sequence[float], title: str, lrs: Sequence[float] = ()) -> None:
    """Save a PNG of train and test loss per epoch to ``path`` (a file name or a binary
    file). Log scale when every finite loss is positive and there are several epochs.
    ``lrs``: the learning rate of each optimizer step; drawn in a panel below when it
    changed during the run."""
    from PIL import Image, ImageDraw

    panel = len(set(lrs)) > 1
    image = Image.new("RGB", (WIDTH, HEIGHT + (LR_HEIGHT if panel else 0)), "white")
    draw = ImageDraw.Draw(image)
    font = _font(12)
    values = [v for v in (*train, *test) if math.isfinite(v)]
    log = len(xs) > 1 and bool(values) and all(v > 0 for v in values)
    y_low, y_high, y_ticks = _y_axis(values, log)
    x_low, x_high = (min(xs), max(xs)) if xs else (0, 1)
    if x_low == x_high:
        x_low, x_high = x_low - 1, x_high + 1
    box = (LEFT, TOP, WIDTH - RIGHT, HEIGHT - BOTTOM)

    def px(x: float) -> float:
        return box[0] + (x - x_low) / (x_high - x_low) * (box[2] - box[0])

    def py(y: float) -> float:
        low, high, value = ((math.log10(y_low), math.log10(y_high), math.log10(y)) if log
                            else (y_low, y_high, y))
        return box[3] - (value - low) / (high - low) * (box[3] - box[1])

    for tick in y_ticks:
        draw.line([(box[0], py(tick)), (box[2], py(tick))], fill=GRID)
        label = _label(tick)
        width = draw.textlength(label, font=font)
        draw.text((box[0] - 6 - width, py(tick) - 7), label, fill=INK, font=font)
    for tick in _nice_ticks(x_low, x_high, 8, integers=True):
        draw.line([(px(tick), box[1]), (px(tick), box[3])], fill=GRID)
        label = _label(tick)
        draw.text((px(tick) - draw.textlength(label, font=font) / 2, box[3] + 6), label,
                  fill=INK, font=font)
    draw.rectangle(box, outline=INK)
    for name, series, square in (("train", train, False), ("test", test, True)):
        _series(draw, [(px(x), py(y)) if math.isfinite(y) and (not log or y > 0) else None
                       for x, y in zip(xs, series, strict=True)], COLORS[name], square)
    _legend(draw, font, box)
    _centered(draw, title, (box[0] + box[2]) / 2, 10, _font(14))
    _centered(draw, "epoch", (box[0] + box[2]) / 2, HEIGHT - 20, font)
    _vertical(image, "loss", 8, (box[1] + box[3]) / 2, font)
    if panel:
        _lr_panel(image, draw, font, lrs)
    image.save(path, format="PNG")


def _lr_panel(image: Any, draw: Any, font: Any, lrs: Sequence[float]) -> None:
    """The learning rate per optimizer step (``lrs``: at least two values), on a linear
    axis from 0, under the loss chart."""
    box = (LEFT, HEIGHT, WIDTH - RIGHT, HEIGHT + LR_HEIGHT - BOTTOM)
    count, high = len(lrs), max(max(lrs), 1e-300)
    ticks = [t for t in _nice_ticks(0.0, high, 4) if 0 <= t <= high * 1.0001]
    top = max([high, *ticks]) * 1.05

    def px(step: float) -> float:
        return box[0] + (step - 1) / max(count - 1, 1) * (box[2] - box[0])

    def py(value: float) -> float:
        return box[3] - value / top * (box[3] - box[1])

    for tick in ticks:
        draw.line([(box[0], py(tick)), (box[2], py(tick))], fill=GRID)
        label = _label(tick)
        draw.text((box[0] - 6 - draw.textlength(label, font=font), py(tick) - 7), label,
                  fill=INK, font=font)
    for tick in _nice_ticks(1, max(count, 2), 8, integers=True):
        if 1 <= tick <= count:
            label = _label(tick)
            draw.text((px(tick) - draw.textlength(label, font=font) / 2, box[3] + 6), label,
                      fill=INK, font=font)
    draw.rectangle(box, outline=INK)
    draw.line([(px(i + 1), py(v)) for i, v in enumerate(lrs)], fill=LR_COLOR, width=2)
    _centered(draw, "optimizer step", (box[0] + box[2]) / 2, box[3] + 22, font)
    _vertical(image, "lr", 8, (box[1] + box[3]) / 2, font)


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # Pillow >= 10.1: a scalable font
    except TypeError:  # older Pillow: its fixed bitmap font
        return ImageFont.load_default()


def _y_axis(values: list[float], log: bool) -> tuple[float, float, list[float]]:
    """(low, high, ticks) of the loss axis."""
    if not values:
        return 0.0, 1.0, [0.0, 0.5, 1.0]
    low, high = min(values), max(values)
    if log:
        low_exp, high_exp = math.floor(math.log10(low)), math.ceil(math.log10(high))
        if high_exp - low_exp >= 2:  # decades
            ticks = [10.0 ** e for e in range(low_exp, high_exp + 1)]
            return 10.0 ** low_exp, 10.0 ** high_exp, ticks
        ticks = [t for t in _nice_ticks(low, high, 6) if t > 0]
        pad = (high / low) ** 0.05
        bottom, top = min([low / pad, *ticks]), max([high * pad, *ticks])
        return bottom, top, ticks
    if low == high:
        low, high = low - 1.0, high + 1.0
    pad = (high - low) * 0.05  # the extreme points inside the frame
    low, high = low - pad, high + pad
    ticks = _nice_ticks(low, high, 6)
    return low, high, ticks


def _nice_ticks(low: float, high: float, count: int, integers: bool = False) -> list[float]:
    """About ``count`` round values (1, 2, 5 x 10^k steps) covering [low, high]."""
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10.0 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    if integers:
        step = max(1.0, round(step))
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        if value >= low - step * 1e-9:
            ticks.append(round(value, 12))
        value += step
    return ticks or [low, high]


def _label(value: float) -> str:
    if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
        return f"{value:.0e}"
    return f"{value:g}"


def _series(draw: Any, points: list[tuple[float, float] | None], color: tuple[int, int, int],
            square: bool) -> None:
    run: list[tuple[float, float]] = []
    for point in [*points, None]:  # a gap (None) ends a run of the line
        if point is None:
            if len(run) > 1:
                draw.line(run, fill=color, width=2)
            run = []
            continue
        run.append(point)
    radius = 3 if len(points) <= 60 else 2
    for point in points:
        if point is not None:
            x, y = point
            shape = draw.rectangle if square else draw.ellipse
            shape([x - radius, y - radius, x + radius, y + radius], fill=color)


def _legend(draw: Any, font: Any, box: tuple[float, float, float, float]) -> None:
    right, top = box[2] - 8, box[1] + 8
    widths = [draw.textlength(name, font=font) for name in COLORS]
    left = right - max(widths) - 34
    draw.rectangle([left, top, right, top + 40], fill="white", outline=GRID)
    for row, (name, color) in enumerate(COLORS.items()):
        y = top + 12 + row * 16
        draw.line([(left + 6, y), (left + 24, y)], fill=color, width=2)
        draw.text((left + 28, y - 7), name, fill=INK, font=font)


def _centered(draw: Any, text: str, x: float, y: float, font: Any) -> None:
    draw.text((x - draw.textlength(text, font=font) / 2, y), text, fill=INK, font=font)


def _vertical(image: Any, text: str, x: int, y: float, font: Any) -> None:
    """``text`` rotated a quarter turn, centred on ``y`` (the y axis' name)."""
    from PIL import Image, ImageDraw

    width = int(ImageDraw.Draw(image).textlength(text, font=font)) + 4
    label = Image.new("RGB", (width, 16), "white")
    ImageDraw.Draw(label).text((2, 0), text, fill=INK, font=font)
    rotated = label.rotate(90, expand=True)
    image.paste(rotated, (x, int(y - rotated.height / 2)))
