"""Metrics are plug-ins: functions averaged over the evaluation samples, or objects with
reset/update/compute (torchmetrics-style) for metrics that are not a mean, R² and
accuracy among them; evaluation and the run's records carry exactly the task's metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.step_limit import train_until
from torchgpu.errors import UsageError
from torchgpu.train.metrics import R2, Accuracy, Tally, aggregates, check_metrics
from torchgpu.train.outputs.evaluation import evaluate

CPU = torch.device("cpu")


def _batches(x: torch.Tensor, y: torch.Tensor, size: int) -> list[tuple[torch.Tensor, Any]]:
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


def test_r2_is_the_whole_splits_in_float64_whatever_the_batches() -> None:
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(50, 1, generator=gen) * 3 + 20
    out = y + torch.randn(50, 1, generator=gen)
    yd, od = y.double(), out.double()
    want = 1 - float(((od - yd) ** 2).sum()) / float(((yd - yd.mean()) ** 2).sum())
    for size in (1, 7, 50):
        got = evaluate(nn.Identity(), _batches(out, y, size), nn.MSELoss(), device=CPU,
                       metrics={"r2": R2()}).metrics["r2"]
        assert got == pytest.approx(want, rel=1e-12), size
    # targets that do not vary have no R²; no samples neither
    flat = evaluate(nn.Identity(), [(out, torch.ones(50, 1))], nn.MSELoss(), device=CPU,
                    metrics={"r2": R2()})
    assert math.isnan(flat.metrics["r2"])
    assert math.isnan(R2().compute())


def test_accuracy_over_uneven_batches_is_the_share_of_all_samples() -> None:
    logits = torch.tensor([[2.0, 0.0]] * 5 + [[0.0, 2.0]] * 2)
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 1])  # 3 + 2 of 7 right
    result = evaluate(nn.Identity(), _batches(logits, labels, 3), nn.CrossEntropyLoss(),
                      device=CPU, metrics={"accuracy": Accuracy()})
    assert result.metrics["accuracy"] == pytest.approx(5 / 7)
    assert result.samples == 7


class Largest:
    """A torchmetrics-style metric that is not a mean: the largest absolute error."""

    def __init__(self) -> None:
        self.value = torch.tensor(-1.0)
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1
        self.value = torch.tensor(0.0)

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        self.value = torch.maximum(self.value, (output - target).abs().max())

    def compute(self) -> torch.Tensor:
        return self.value  # a one-element tensor, as torchmetrics returns


def test_functions_are_weighted_by_rows_and_objects_aggregate() -> None:
    x = torch.arange(10.0).reshape(10, 1)
    y = torch.zeros(10, 1)
    largest = Largest()
    metrics: dict[str, Any] = {"mean_abs": lambda out, t: float((out - t).abs().mean()),
                               "largest": largest}
    first = evaluate(nn.Identity(), _batches(x, y, 4), nn.MSELoss(), device=CPU,
                     metrics=metrics)
    # batches of 4, 4, 2 rows: the per-batch means weighted by rows are the overall mean
    assert first.metrics["mean_abs"] == pytest.approx(4.5)
    assert first.metrics["largest"] == 9.0
    # the object is reset before each evaluation: a second one does not carry the first
    second = evaluate(nn.Identity(), _batches(x[:3], y[:3], 4), nn.MSELoss(), device=CPU,
                      metrics=metrics)
    assert second.metrics == {"mean_abs": pytest.approx(1.0), "largest": 2.0}
    assert largest.resets == 2
    empty = evaluate(nn.Identity(), [], nn.MSELoss(), device=CPU, metrics=metrics)
    assert empty.samples == 0 and math.isnan(empty.loss)
    assert all(math.isnan(v) for v in empty.metrics.values())


def test_a_tensor_metric_must_be_one_number() -> None:
    tally = Tally({"wide": lambda out, t: out})
    with pytest.raises(UsageError, match=r"metric 'wide' returned a tensor of shape \(2, 1\)"):
        tally.update(torch.zeros(2, 1), torch.zeros(2, 1), 2)


def test_check_metrics_refuses_what_cannot_be_a_metric() -> None:
    assert aggregates(Largest()) and aggregates(R2()) and not aggregates(len)
    assert set(check_metrics({"a": len, "b": R2()})) == {"a", "b"}
    assert check_metrics(None) == {}
    for bad, needle in (({"loss": len}, "would be reported as test_loss"),
                        ({"": len}, "not a non-empty string"),
                        ({3: len}, "not a non-empty string"),
                        ({"x": 3.5}, r"metrics\['x'\] is a float")):
        with pytest.raises(UsageError, match=needle):
            check_metrics(bad)


def test_fit_records_an_aggregated_metric_and_only_the_tasks_metrics(tmp_path: Path) -> None:
    from torchgpu import fit

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, generator=gen)
    y = x.sum(dim=1, keepdim=True)
    result = fit(lambda: nn.Linear(3, 1), TensorDataset(x, y),
                 eval_data=TensorDataset(x[:10], y[:10]), loss=nn.MSELoss(),
                 metrics={"largest": Largest(), "r2": R2()}, epochs=2, batch_size=8,
                 device="cpu", progress="off", out=tmp_path / "run")
    epochs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
              .splitlines() if '"kind": "epoch"' in line]
    assert [sorted(k for k in e if k.startswith("test_")) for e in epochs] == [
        ["test_largest", "test_loss", "test_r2"]] * 2
    final = result.summary["final"]
    assert final["test_largest"] == epochs[-1]["test_largest"] > 0
    assert final["test_r2"] == epochs[-1]["test_r2"]
    assert "test_accuracy" not in final


def test_a_resumed_run_keeps_the_metrics_of_the_epochs_before_its_stop(tmp_path: Path) -> None:
    """The checkpoint's epoch records give back every test_<name> (metrics.jsonl is
    rewritten from them on resume, and summary.json reads them)."""
    from torchgpu.train.fit import config_from_settings
    from torchgpu.train.runner import train
    from torchgpu.train.task import seeded, user_task

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(40, 3, generator=gen)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    task = user_task(seeded(lambda: nn.Linear(3, 1), 0), data, data, loss=nn.MSELoss(),
                     metrics={"largest": Largest(),
                              "mean_abs": lambda out, t: float((out - t).abs().mean())})
    settings = {"epochs": 3, "batch_size": 8, "device": "cpu", "progress": "off",
                "save_every": 1}

    def run(out: str, stop_at: int | None = None) -> Any:
        return train_until(stop_at, config_from_settings(
            {**settings, "out": str(tmp_path / out)}, "lin"), task=task)

    def epochs(out: str) -> list[dict[str, Any]]:
        lines = (tmp_path / out / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k not in ("seconds", "samples_per_s")}
                for x in lines if '"kind": "epoch"' in x]

    whole = run("whole")
    run("stopped", stop_at=7)  # 5 steps per epoch: stopped in the second epoch
    resumed = train(config_from_settings({**settings, "out": str(tmp_path / "stopped"),
                                          "resume": True}, "lin"), task=task)
    assert epochs("stopped") == epochs("whole")
    assert all("test_largest" in e and "test_mean_abs" in e for e in epochs("stopped"))
    assert resumed.summary["final"] == whole.summary["final"]
