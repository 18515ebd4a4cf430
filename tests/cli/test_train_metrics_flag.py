"""`torchgpu train --metrics NAME|SPEC[,...]`: evaluation metrics from the command line,
written as test_<name> like the task's own; a bad spec is one paragraph, exit 2, and
nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import run_main

RUN = ["train", "--example", "housing", "--data-size", "100", "--epochs", "2",
       "--batch-size", "16", "--progress", "off", "--device", "cpu"]

METRICS_PY = '''
import torch


def mae(output, target):
    return float((output - target.reshape(output.shape)).abs().mean())


class MaxError:
    def reset(self):
        self.worst = 0.0

    def update(self, output, target):
        error = (output - target.reshape(output.shape)).abs().max()
        self.worst = max(self.worst, float(error))

    def compute(self):
        return torch.tensor(self.worst)


NOT_A_METRIC = 3
'''


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    path = tmp_path / "my_metrics.py"
    path.write_text(METRICS_PY)
    return path


def test_metrics_from_specs_and_names_are_written_as_test_metrics(
    tmp_path: Path, specs: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    code, err = run_main([*RUN, "--out", str(out), "--metrics",
                          f"{specs}:mae,{specs}:MaxError,accuracy"], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    final = summary["final"]
    assert final["test_mae"] > 0 and final["test_MaxError"] > 0
    assert final["test_MaxError"] >= final["test_mae"]  # the worst error >= the mean one
    assert "test_r2" in final and "test_accuracy" in final  # the task's metric is kept
    epochs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()
              if '"epoch"' in x and '"kind": "epoch"' in x]
    assert len(epochs) == 2 and all("test_mae" in e and "test_MaxError" in e for e in epochs)
    # The spec is recorded absolute in config.toml, so the run can be repeated from there.
    assert f'metrics = "{specs}:mae,{specs}:MaxError,accuracy"' in (
        out / "config.toml").read_text()


@pytest.mark.parametrize(("value", "words"), [
    ("f1", "'f1' is neither a built-in metric (r2, accuracy) nor a spec"),
    ("{specs}:missing", "has no attribute 'missing'"),
    ("{specs}:NOT_A_METRIC", "NOT_A_METRIC is a int"),
    ("{tmp}/nope.py:fn", "nope.py"),
    ("{specs}:mae,{specs}:mae", "'mae' is named twice"),
    ("r2,", "'' is neither"),
])
def test_a_bad_metric_spec_exits_2_and_writes_nothing(
    tmp_path: Path, specs: Path, capsys: pytest.CaptureFixture[str], value: str, words: str
) -> None:
    out = tmp_path / "run"
    code, err = run_main([*RUN, "--out", str(out), "--metrics",
                          value.format(specs=specs, tmp=tmp_path)], capsys)
    assert code == 2
    assert words in err and "--metrics" in err
    assert len(err.strip().splitlines()) == 1  # one paragraph
    assert not out.exists()
