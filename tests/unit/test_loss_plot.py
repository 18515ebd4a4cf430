"""loss.png, drawn with Pillow: both losses and a legend, log or linear scale, gaps for
non-finite losses, the same bytes to a path or a binary file, no matplotlib; the
metrics lines are what json.dumps writes."""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.procs import test_env
from torchgpu.train.outputs import loss_plot
from torchgpu.train.outputs.files import EpochRecord, MetricsBuffer, plot_losses
from torchgpu.train.outputs.loss_plot import render

XS = list(range(1, 31))
TRAIN = [500.0 / x for x in XS]
TEST = [600.0 / x + 0.5 for x in XS]
TITLE = "housing: single, 1 process(es)"


def _records() -> list[EpochRecord]:
    return [EpochRecord(epoch=x - 1, step=x * 26, train_loss=a, test_loss=b,
                        samples_per_s=1.0, seconds=0.01, metrics={"r2": 0.5})
            for x, a, b in zip(XS, TRAIN, TEST, strict=True)]


def _pixels(path: Path | io.BytesIO) -> Any:
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (loss_plot.WIDTH, loss_plot.HEIGHT)
        return image.convert("RGB")


def _count(image: Any, color: tuple[int, int, int]) -> int:
    return int((np.asarray(image) == np.array(color, dtype=np.uint8)).all(axis=-1).sum())


def test_the_plot_shows_both_losses_with_a_legend(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    plot_losses(path, _records(), TITLE)
    image = _pixels(path)
    # each series in its colour: the line, markers and legend swatch
    assert _count(image, loss_plot.COLORS["train"]) > 200
    assert _count(image, loss_plot.COLORS["test"]) > 200


def test_a_binary_file_takes_the_same_png(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    render(path, XS, TRAIN, TEST, TITLE)
    buffer = io.BytesIO()
    render(buffer, XS, TRAIN, TEST, TITLE)
    assert buffer.getvalue() == path.read_bytes()


def test_log_scale_for_positive_losses_linear_otherwise() -> None:
    assert loss_plot._y_axis([0.5, 500.0], log=True)[2] == [0.1, 1.0, 10.0, 100.0, 1000.0]
    low, high, ticks = loss_plot._y_axis([-1.0, 2.0], log=False)
    assert low < -1.0 and high > 2.0 and ticks[0] >= low and ticks[-1] <= high
    assert ticks == sorted(set(ticks))


@pytest.mark.parametrize(("train", "test"), [
    ([1.0, math.nan, 0.5], [math.nan, math.nan, math.nan]),  # no held-out data, a gap
    ([-1.0, 0.0, 2.0], [1.0, 1.0, 1.0]),  # not all positive: linear
    ([math.nan] * 3, [math.inf] * 3),  # nothing finite
    ([3.0], [4.0]),  # one epoch
])
def test_unusual_losses_still_give_a_plot(tmp_path: Path, train: list[float],
                                          test: list[float]) -> None:
    path = tmp_path / "loss.png"
    render(path, list(range(1, len(train) + 1)), train, test, "edge")
    _pixels(path)


def test_drawing_imports_no_matplotlib() -> None:
    code = ("import sys, io\n"
            "from torchgpu.train.outputs.loss_plot import render\n"
            "render(io.BytesIO(), [1, 2], [2.0, 1.0], [3.0, 2.0], 't')\n"
            "assert 'matplotlib' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=test_env())
    assert done.returncode == 0, done.stderr


def test_step_lines_are_what_json_dumps_writes() -> None:
    values = [577.0069580078125, 1e-300, 1e300, -0.0, 3.0, math.nan, math.inf, -math.inf,
              float(np.float64(0.1)), np.float64(2.5)]
    buffer = MetricsBuffer(steps=[(i + 1, i // 3, v) for i, v in enumerate(values)])
    lines = buffer.take_lines()
    assert buffer.steps == []
    for i, (line, value) in enumerate(zip(lines, values, strict=True)):
        expected = json.dumps({"kind": "step", "step": i + 1, "epoch": i // 3,
                               "loss": float(value) if math.isfinite(value) else None})
        assert line == expected
        assert json.loads(line)["step"] == i + 1
