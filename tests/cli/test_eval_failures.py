"""Evaluation never costs a trained epoch: a held-out split the model does not take is
refused before training (exit 2, the split and both shapes named), and an evaluation that
fails anyway keeps the epoch's checkpoint and step losses, says so in one paragraph, and
``--resume`` / ``resume=True`` evaluates that epoch again; from the command line
(``--model``/``--data`` specs) and from ``fit``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.procs import run_main
from tests.user_models import EVAL_FAILS_ENV, narrow_eval_data, seq_factory
from torchgpu import fit
from torchgpu.errors import DataError, EvaluationError

MODELS = "tests.user_models"
# seq_factory on 40 rows, batch 8: 5 optimizer steps per epoch
SPECS = ["--model", f"{MODELS}:seq_factory", "--loss", "mse", "--batch-size", "8",
         "--epochs", "3", "--progress", "off"]


def _lines(out: Path, kind: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
            if f'"kind": "{kind}"' in line]


def test_an_eval_split_of_another_width_is_refused_before_training(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    code, err = run_main(["train", *SPECS, "--data", f"{MODELS}:narrow_eval_data",
                          "--out", str(out)], capsys)
    text = " ".join(err.split())
    assert code == 2, err
    assert f"the evaluation split of --data {MODELS}:narrow_eval_data" in text
    assert "inputs (2, 3)" in text and "inputs (2, 4)" in text  # both splits' shapes
    assert "give the evaluation split what the training split has" in text
    assert not out.exists()  # refused before --out was made: nothing trained, nothing lost


def test_fit_refuses_an_eval_data_of_another_width_before_training(tmp_path: Path) -> None:
    train, held_out = narrow_eval_data()
    with pytest.raises(DataError, match=r"fails on two samples of eval_data \(inputs \(2, 3\)"):
        fit(seq_factory, train, eval_data=held_out, loss=nn.MSELoss(), epochs=1,
            out=tmp_path / "run", progress="off")
    assert not (tmp_path / "run").exists()


def test_a_failing_evaluation_keeps_the_epoch_and_resume_evaluates_it_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "run"
    argv = ["train", *SPECS, "--data", f"{MODELS}:failing_eval_data", "--out", str(out)]
    monkeypatch.setenv(EVAL_FAILS_ENV, "1")
    code, err = run_main(argv, capsys)
    text = " ".join(err.split())
    assert code == 1, err
    assert "the evaluation after epoch 1 of 3 (step 5) failed: OSError" in text
    assert str(out / "checkpoints" / "step-00000005") in text and "--resume" in text
    assert [line["step"] for line in _lines(out, "step")] == [1, 2, 3, 4, 5]
    monkeypatch.delenv(EVAL_FAILS_ENV)  # the data is back
    code, err = run_main([*argv, "--resume"], capsys)
    assert code == 0, err
    assert [line["step"] for line in _lines(out, "step")] == list(range(1, 16))
    assert [line["epoch"] for line in _lines(out, "epoch")] == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 15 and summary["final"]["test_loss"] is not None


def test_fit_keeps_epoch_2_when_a_metric_fails_there(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    train, held_out = (TensorDataset(torch.randn(rows, 4, generator=generator),
                                     torch.randn(rows, 1, generator=generator))
                       for rows in (40, 8))
    evaluations = {"n": 0, "fail_at": 2}  # fails in the second evaluation only

    def flaky(output: torch.Tensor, target: torch.Tensor) -> float:
        if evaluations["n"] == evaluations["fail_at"]:
            raise ValueError("the metric's lookup table is missing")
        return 0.0

    class Counting:  # counts evaluations: reset() runs once before each
        def reset(self) -> None:
            evaluations["n"] += 1

        def update(self, output: Any, target: Any) -> None:
            pass

        def compute(self) -> float:
            return 1.0

    out = tmp_path / "run"
    settings: dict[str, Any] = {"eval_data": held_out, "loss": nn.MSELoss(), "epochs": 3,
                                "batch_size": 8, "out": out, "progress": "off",
                                "metrics": {"count": Counting(), "flaky": flaky}}
    with pytest.raises(EvaluationError, match=r"evaluation after epoch 2 of 3 \(step 10\)"):
        fit(seq_factory, train, **settings)
    assert (out / "checkpoints" / "step-00000010" / "model.safetensors").is_file()
    assert [line["epoch"] for line in _lines(out, "epoch")] == [0]  # epoch 1 complete
    assert [line["step"] for line in _lines(out, "step")] == list(range(1, 11))
    evaluations.update(n=0, fail_at=0)  # fixed
    result = fit(seq_factory, train, resume=True, **settings)
    assert result.summary["steps"] == 15
    assert [line["epoch"] for line in _lines(out, "epoch")] == [0, 1, 2]
    assert [line["step"] for line in _lines(out, "step")] == list(range(1, 16))
