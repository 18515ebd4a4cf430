"""A run is assembled once: validate, resolve, decide, data, model, each exactly once per
process, in that order (auto: the planner after data and model), before ``--out``
exists (torchgpu.train.assemble)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchgpu
from torchgpu.cli.main import main
from torchgpu.examples import housing
from torchgpu.train import assemble, config, config_checks, plugin
from torchgpu.train import auto_strategy as auto_strategy
from torchgpu.train.strategies import placing as build


def _count(monkeypatch: pytest.MonkeyPatch, events: list[str], name: str, module: Any,
           attr: str, *also: Any) -> None:
    original = getattr(module, attr)

    def counted(*args: Any, **kwargs: Any) -> Any:
        events.append(name)
        return original(*args, **kwargs)

    for where in (module, *also):
        monkeypatch.setattr(where, attr, counted)


@pytest.fixture
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    _count(monkeypatch, seen, "validate", config_checks, "validate", assemble, auto_strategy)
    _count(monkeypatch, seen, "resolve", config, "resolve", assemble)
    _count(monkeypatch, seen, "data", housing, "load")
    _count(monkeypatch, seen, "task", plugin, "task_for_config", assemble)
    _count(monkeypatch, seen, "choose_device", build, "choose_device")
    _count(monkeypatch, seen, "choose_strategy", build, "choose_strategy")
    _count(monkeypatch, seen, "decide_strategy", auto_strategy, "decide_strategy", assemble)
    return seen


def _model_counter(monkeypatch: pytest.MonkeyPatch, events: list[str], out: Path) -> None:
    import torchgpu.models as models

    original = models.build_model

    def counted(*args: Any, **kwargs: Any) -> nn.Module:
        assert not out.exists(), "the model was built after --out was created"
        events.append("model")
        return original(*args, **kwargs)

    monkeypatch.setattr(models, "build_model", counted)


@pytest.mark.parametrize("strategy", ["auto", "single"])
def test_cli_run_assembles_each_piece_once_in_order(
        strategy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        events: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    _model_counter(monkeypatch, events, out)
    code = main(["train", "--example", "housing", "--data-size", "60", "--epochs", "1",
                 "--device", "cpu", "--strategy", strategy, "--progress", "off",
                 "--out", str(out)])
    assert code == 0 and (out / "summary.json").exists()
    decide = ["choose_device", "choose_strategy"]
    pieces = ["task", "data", "model"]
    if strategy == "auto":  # the planner measures data and model, then the rest decides
        assert events == ["validate", "resolve", *pieces, "decide_strategy", *decide]
    else:
        assert events == ["validate", "resolve", *decide, *pieces]


def test_fit_builds_the_model_once_with_strategy_auto(tmp_path: Path) -> None:
    built: list[int] = []

    def factory() -> nn.Module:
        built.append(1)
        return nn.Linear(3, 1)

    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    result = torchgpu.fit(factory, data, loss=nn.MSELoss(), strategy="auto", epochs=1,
                          batch_size=8, device="cpu", progress="off", out=tmp_path / "fit")
    assert built == [1]
    assert result.summary["strategy"] == "single"


def test_bad_device_is_refused_before_out_exists(tmp_path: Path) -> None:
    from torchgpu.errors import TorchGpuError

    out = tmp_path / "bad"
    with pytest.raises(TorchGpuError):
        torchgpu.fit(nn.Linear(3, 1), TensorDataset(torch.randn(8, 3), torch.randn(8, 1)),
                     loss=nn.MSELoss(), precision="fp16", device="cpu", epochs=1, out=out)
    assert not out.exists()
