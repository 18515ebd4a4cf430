"""The built-in examples are plug-ins on the user's route, and ``--optimizer`` picks the
optimizer: a user plug-in made of the housing example's pieces (its data, net, MSE and
``--optimizer adam``) trains to the same bytes as ``--example housing``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchgpu.cli.main import main
from torchgpu.examples import PLUGINS, housing, table
from torchgpu.train.config import EXAMPLES, TrainConfig, resolve
from torchgpu.train.metrics import R2, Accuracy

QUICK = ["--data-size", "100", "--epochs", "2", "--batch-size", "16", "--device", "cpu",
         "--strategy", "single", "--progress", "off"]

# A user's plug-in built from the housing example's pieces, as a user would write it.
HOUSING_PIECES = '''
import torch
from torchgpu.data import example_data
from torchgpu.models import HousingNet


def net():
    return HousingNet(in_dim=13, out_dim=1)


def data():
    split = example_data("housing", seed=0, size=100)
    return split.train, split.test


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def not_an_optimizer(params):
    return list(params)


not_callable = 3
'''


def _pieces(tmp_path: Path) -> Path:
    path = tmp_path / "pieces.py"
    path.write_text(HOUSING_PIECES)
    return path


def _train(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["train", *args])
    return code, capsys.readouterr().err


def _epochs(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "epoch"]


def test_every_example_name_has_a_plug_in_with_its_metrics() -> None:
    assert tuple(PLUGINS) == EXAMPLES
    wanted = {"housing": ("r2", R2), "lenet": ("accuracy", Accuracy),
              "resnet50": ("accuracy", Accuracy)}
    for name, plug_in in PLUGINS.items():
        task = plug_in(resolve(TrainConfig(example=name, data_size=12, batch_size=4,
                                           out="unused")))
        metric, kind = wanted[name]
        assert list(task.metrics) == [metric] and isinstance(task.metrics[metric], kind)
        assert task.optimizer == "adam" and task.eval_batch(4) == 256
        assert task.eval_batch(512) == 512  # never below the training batch
        assert task.example is not None and len(task.train) == task.train_rows
        assert task.trusted  # a built-in model takes its data: no probe before --out


def test_a_user_plug_in_of_the_same_pieces_equals_example_housing_bitwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _pieces(tmp_path)
    code, err = _train(capsys, "--example", "housing", *QUICK, "--out", str(tmp_path / "ex"))
    assert code == 0, err
    user = ["--model", f"{spec}:net", "--data", f"{spec}:data", "--loss", "mse", *QUICK[2:]]
    code, err = _train(capsys, *user, "--optimizer", "adam", "--lr", "0.01",
                       "--out", str(tmp_path / "user"))
    assert code == 0, err
    example = (tmp_path / "ex" / "model.safetensors").read_bytes()
    assert (tmp_path / "user" / "model.safetensors").read_bytes() == example
    # Without --optimizer a user's model trains with AdamW: not the same weights.
    code, err = _train(capsys, *user, "--lr", "0.01", "--out", str(tmp_path / "adamw"))
    assert code == 0, err
    assert (tmp_path / "adamw" / "model.safetensors").read_bytes() != example
    # The epoch records carry the task's metrics only: R² for the example, none for the
    # user's run (no test_r2: null, no test_accuracy).
    assert [sorted(k for k in e if k.startswith("test_")) for e in _epochs(tmp_path / "ex")
            ] == [["test_loss", "test_r2"]] * 2
    assert [sorted(k for k in e if k.startswith("test_")) for e in _epochs(tmp_path / "user")
            ] == [["test_loss"]] * 2
    summary = json.loads((tmp_path / "user" / "summary.json").read_text())
    assert set(summary["final"]) == {"train_loss", "test_loss"}


def test_fit_with_the_same_pieces_and_optimizer_adam_equals_example_housing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from torchgpu import fit
    from torchgpu.data import example_data
    from torchgpu.models import HousingNet

    code, err = _train(capsys, "--example", "housing", *QUICK, "--out", str(tmp_path / "ex"))
    assert code == 0, err
    split = example_data("housing", seed=0, size=100)
    result = fit(lambda: HousingNet(in_dim=13), split.train, eval_data=split.test,
                 loss=nn.MSELoss(), metrics={"r2": R2()}, optimizer="adam", lr=0.01,
                 epochs=2, batch_size=16, device="cpu", strategy="single", progress="off",
                 out=tmp_path / "fit")
    assert ((tmp_path / "fit" / "model.safetensors").read_bytes()
            == (tmp_path / "ex" / "model.safetensors").read_bytes())
    example = json.loads((tmp_path / "ex" / "summary.json").read_text())["final"]
    assert result.summary["final"]["test_r2"] == example["test_r2"]  # R² as a plug-in metric
    assert 'optimizer = "adam"' in (tmp_path / "fit" / "config.toml").read_text()


def test_optimizer_sgd_and_specs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _pieces(tmp_path)
    for name, extra in (("sgd", ["--optimizer", "sgd"]),
                        ("spec", ["--optimizer", f"{spec}:sgd"]),
                        ("class", ["--optimizer", "torch.optim:RMSprop"])):
        code, err = _train(capsys, "--example", "housing", *QUICK, *extra,
                           "--out", str(tmp_path / name))
        assert code == 0, (name, err)
    sgd = (tmp_path / "sgd" / "model.safetensors").read_bytes()
    assert sgd != (tmp_path / "spec" / "model.safetensors").read_bytes()  # momentum 0.9
    # config.toml records the spec (absolute file path) and reproduces the run bitwise
    written = (tmp_path / "spec" / "config.toml").read_text()
    assert f'optimizer = "{spec}:sgd"' in written
    code, err = _train(capsys, "--config", str(tmp_path / "spec" / "config.toml"),
                       "--out", str(tmp_path / "again"))
    assert code == 0, err
    assert ((tmp_path / "again" / "model.safetensors").read_bytes()
            == (tmp_path / "spec" / "model.safetensors").read_bytes())


@pytest.mark.parametrize(
    ("optimizer", "needle"),
    [
        ("lion", "unknown optimizer 'lion': allowed are adam, adamw, sgd"),
        ("{spec}:missing", "has no attribute 'missing'"),
        ("{spec}:not_callable", "not_callable is a int, which is not callable"),
        ("{spec}:not_an_optimizer", "not_an_optimizer returned a list, not a torch.optim"),
        ("{spec}:net", "the optimizer factory net failed on the model's parameters (TypeError"),
    ],
)
def test_a_bad_optimizer_exits_2_and_writes_nothing(
        optimizer: str, needle: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    spec = _pieces(tmp_path)
    out = tmp_path / "run"
    code, err = _train(capsys, "--example", "housing", *QUICK,
                       "--optimizer", optimizer.format(spec=spec), "--out", str(out))
    assert code == 2 and needle in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_model_on_a_csv_keeps_the_table_plug_in_with_the_users_model(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--model on a CSV: the table's data, MSE, R² and evaluation batch, the user's model
    with AdamW; --optimizer adam makes it the table plug-in's run, byte for byte."""
    from torchgpu.data import write_housing_csv

    csv = write_housing_csv(tmp_path / "h.csv")
    spec = _pieces(tmp_path)
    args = ["--data", str(csv), "--target", "MEDV", "--epochs", "1", "--device", "cpu",
            "--lr", "0.01", "--batch-size", "32",
            "--strategy", "single", "--progress", "off"]
    config = resolve(TrainConfig(model=f"{spec}:net", data=str(csv), target="MEDV",
                                 out="unused"))
    from torchgpu.train.plugin import task_for_config

    task = task_for_config(config)
    assert task.optimizer == "adamw" and list(task.metrics) == ["r2"] and not task.trusted
    assert task.eval_batch(32) == 256 and task.example is not None
    assert _train(capsys, *args, "--out", str(tmp_path / "table"))[0] == 0
    assert _train(capsys, *args, "--model", f"{spec}:net", "--optimizer", "adam",
                  "--out", str(tmp_path / "user"))[0] == 0
    assert ((tmp_path / "user" / "model.safetensors").read_bytes()
            == (tmp_path / "table" / "model.safetensors").read_bytes())
    assert "test_r2" in _epochs(tmp_path / "user")[0]


def test_the_table_plug_in_is_the_housing_net_on_the_csv(tmp_path: Path) -> None:
    from torchgpu.data import write_housing_csv

    csv = write_housing_csv(tmp_path / "h.csv")
    config = resolve(TrainConfig(data=str(csv), target="MEDV", out="unused"))
    task = table.task(config)
    assert task.kind == "regression" and isinstance(task.loss, nn.MSELoss)
    torch.manual_seed(config.seed)
    want = housing.build_model(task.example)  # type: ignore[arg-type]
    got = task.build_model()
    assert all(torch.equal(a, b) for a, b in zip(got.state_dict().values(),
                                                want.state_dict().values(), strict=True))


def test_evaluation_batches_are_the_tasks(tmp_path: Path) -> None:
    """A user's task evaluates in training-sized batches; a task with eval_batch_size
    (the built-in examples: 256) in batches of at least that many rows."""
    import dataclasses

    from torch.utils.data import TensorDataset

    from torchgpu.train.fit import config_from_settings
    from torchgpu.train.runner import train
    from torchgpu.train.task import user_task

    seen: list[int] = []

    def rows(output: torch.Tensor, target: torch.Tensor) -> float:
        seen.append(len(target))
        return 0.0

    x = torch.randn(40, 3)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    task = user_task(lambda: nn.Linear(3, 1), data, data, loss=nn.MSELoss(),
                     metrics={"rows": rows})
    settings = {"epochs": 1, "batch_size": 16, "device": "cpu", "progress": "off"}
    train(config_from_settings({**settings, "out": str(tmp_path / "a")}, "lin"), task=task)
    assert seen == [16, 16, 8]
    seen.clear()
    train(config_from_settings({**settings, "out": str(tmp_path / "b")}, "lin"),
          task=dataclasses.replace(task, eval_batch_size=256))
    assert seen == [40]
