"""Strategies are objects in one registry: a new one is one class plus one registry line,
and validation, the runner and the summary pick it up (torchgpu.train.strategies)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import torchgpu
from torchgpu.errors import UsageError
from torchgpu.train import strategies
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_checks import validate
from torchgpu.train.strategies import Features, Strategy
from torchgpu.train.strategies.stages.strategy import STAGES


class Doubled(Strategy):
    """A stand-in strategy: the model in one process, wrapped in a marker module."""

    name = "doubled"
    processes = "one"
    features = Features(resume="it is a test strategy", precisions=("fp32",),
                        precision_why="it is a test strategy")

    def wrap(self, model: nn.Module, config: Any, task: Any,
             device: torch.device) -> tuple[nn.Module, tuple[str, ...]]:
        return model.to(device), ("note: doubled wrapped the model",)


@pytest.fixture
def doubled(monkeypatch: pytest.MonkeyPatch) -> Strategy:
    made = Doubled()
    monkeypatch.setitem(strategies.REGISTRY, made.name, made)  # the one registry line
    return made


def test_a_registered_strategy_trains_and_is_validated_from_its_features(
        doubled: Strategy, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    result = torchgpu.fit(nn.Linear(3, 1), data, loss=nn.MSELoss(), strategy="doubled",
                          epochs=1, batch_size=8, device="cpu", progress="off",
                          out=tmp_path / "run")
    assert result.summary["strategy"] == "doubled"
    assert "doubled wrapped the model" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--strategy doubled: it is a test strategy"):
        validate(TrainConfig(strategy="doubled", save_every=2))
    with pytest.raises(UsageError, match=r"--precision bf16 .* doubled \(it takes fp32\)"):
        validate(TrainConfig(strategy="doubled", precision="bf16"))
    with pytest.raises(UsageError, match="--chunks 2 only applies to --strategy pipeline"):
        validate(TrainConfig(strategy="doubled", chunks=2))


def test_every_strategy_name_is_the_registry_s() -> None:
    assert strategies.names() == ("auto", "single", "dp", "ddp", "fsdp", "model", "pipeline")
    with pytest.raises(Exception, match="allowed are auto, single, dp"):
        validate(TrainConfig(strategy="zero3"))


@pytest.mark.parametrize(("name", "world", "runs"), [
    ("auto", 1, "single"), ("auto", 2, "ddp"), ("ddp", 1, "single"), ("fsdp", 1, "single"),
    ("pipeline", 1, "pipeline"), ("pipeline", 2, "pipeline"), ("dp", 1, "dp")])
def test_choice_for_the_process_count(name: str, world: int, runs: str) -> None:
    choice = strategies.choose(name, world, torch.device("cpu"))
    assert choice.mode == runs
    assert (choice.strategy is STAGES) == (name == "pipeline" and world > 1)
    assert bool(choice.notes) == (name in ("ddp", "fsdp") and world == 1)


def test_one_process_strategies_refuse_several() -> None:
    for name in ("single", "dp", "model"):
        with pytest.raises(UsageError, match="--nproc"):
            strategies.choose(name, 2, torch.device("cpu"))
