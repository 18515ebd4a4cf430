"""loss.png: the helper process draws the same file as drawing in-process, falls back to
drawing here when it fails, and is used only when it can save time; the metrics lines
are what json.dumps writes."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from torchgpu.train import loss_plot
from torchgpu.train.loss_plot import PlotWorker, render, worth_a_worker
from torchgpu.train.outputs import EpochRecord, MetricsBuffer, plot_losses

XS = list(range(1, 31))
TRAIN = [500.0 / x for x in XS]
TEST = [600.0 / x + 0.5 for x in XS]
TITLE = "housing: single, 1 process(es)"


def _records() -> list[EpochRecord]:
    return [EpochRecord(epoch=x - 1, step=x * 26, train_loss=a, test_loss=b,
                        samples_per_s=1.0, seconds=0.01, metrics={"r2": 0.5})
            for x, a, b in zip(XS, TRAIN, TEST, strict=True)]


def _hide_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a run that has not imported matplotlib (other tests in this process may
    have): the worker is then the one that draws. Undone when the test ends."""
    monkeypatch.delitem(sys.modules, "matplotlib", raising=False)


def test_worker_draws_the_same_png_as_drawing_here(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    worker = PlotWorker.start()
    with monkeypatch.context() as hidden:
        _hide_matplotlib(hidden)
        assert worker.render(tmp_path / "worker.png", XS, TRAIN, TEST, TITLE)
    render(tmp_path / "here.png", XS, TRAIN, TEST, TITLE)
    assert (tmp_path / "worker.png").read_bytes() == (tmp_path / "here.png").read_bytes()
    assert not worker.render(tmp_path / "again.png", XS, TRAIN, TEST, TITLE)  # used once
    worker.close()  # no-op after render


def test_a_worker_is_not_used_once_matplotlib_is_imported_here(tmp_path: Path) -> None:
    import matplotlib  # noqa: F401 - its settings here may differ from the worker's

    worker = PlotWorker.start()
    process = worker._process
    assert not worker.render(tmp_path / "loss.png", XS, TRAIN, TEST, TITLE)
    assert not (tmp_path / "loss.png").exists()  # the caller draws it
    assert process is not None and process.returncode is not None  # ended


def test_a_failed_worker_falls_back_to_drawing_here(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    broken = PlotWorker(subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    with monkeypatch.context() as hidden:
        _hide_matplotlib(hidden)
        assert not broken.render(tmp_path / "loss.png", XS, TRAIN, TEST, TITLE)
    path = tmp_path / "loss.png"
    plot_losses(path, _records(), TITLE, PlotWorker(None))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_worker_reports_an_error_and_the_run_raises_it_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no-such-dir" / "loss.png"
    worker = PlotWorker.start()
    process = worker._process
    with monkeypatch.context() as hidden:
        _hide_matplotlib(hidden)
        assert not worker.render(missing, XS, TRAIN, TEST, TITLE)
    assert process is not None and process.returncode == 1  # it answered with its error
    with pytest.raises(FileNotFoundError):
        plot_losses(missing, _records(), TITLE, PlotWorker.start())


def test_close_ends_an_unused_worker() -> None:
    worker = PlotWorker.start()
    process = worker._process
    assert process is not None
    worker.close()
    assert process.returncode is not None


def test_a_worker_only_when_it_saves_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not worth_a_worker(loss_plot.MIN_OVERLAP_S / 2)
    monkeypatch.setitem(sys.modules, "matplotlib", sys.modules.get("matplotlib") or object())
    assert not worth_a_worker(60.0)  # drawn here, with this process's matplotlib settings
    monkeypatch.delitem(sys.modules, "matplotlib")
    monkeypatch.setattr(loss_plot.os, "sched_getaffinity", lambda pid: {0})
    assert not worth_a_worker(60.0)  # one CPU: it would compete with training
    monkeypatch.setattr(loss_plot.os, "sched_getaffinity", lambda pid: {0, 1})
    assert worth_a_worker(60.0)


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
