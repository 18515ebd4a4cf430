"""`torchgpu train --strategy model|pipeline` in one process on cpu,cpu: the same weights
as the single-device run, labels on the output device, canonical saved keys, the
split-size sweep, and the pure helpers of the split and stage strategies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.utils.data import TensorDataset

from torchgpu.accumulate import GradAccumulator
from torchgpu.errors import BalanceError, ConfigError, UsageError
from torchgpu.models import HousingNet
from torchgpu.parallel.model import SplitModel
from torchgpu.parallel.pipeline import Pipeline
from torchgpu.precision import Precision
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_checks import validate
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.metrics import Accuracy
from torchgpu.train.outputs.evaluation import evaluate
from torchgpu.train.runner import train
from torchgpu.train.state import TrainState
from torchgpu.train.strategies import check_config
from torchgpu.train.strategies.split import build_split_model, default_chunks, parse_balance
from torchgpu.train.strategies.stages.trainer import chunk_ok, chunks_for_rows
from torchgpu.train.task import Task

HOUSING = {"example": "housing", "data_size": 90, "epochs": 2, "batch_size": 8,
           "progress": "off", "device": "cpu"}


def _train(tmp_path: Path, name: str, **kw: Any) -> Any:
    if "devices" in kw:  # --devices places the stages; --device stays auto
        kw.setdefault("device", "auto")
    return train(TrainConfig(out=str(tmp_path / name), **{**HOUSING, **kw}))


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key].cpu(), b[key].cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [
    {"strategy": "model", "devices": "cpu,cpu"},
    {"strategy": "model", "devices": "cpu,cpu,cpu", "balance": "1,2,2"},
    {"strategy": "pipeline", "devices": "cpu,cpu", "chunks": 3},  # uneven micro-batches
    {"strategy": "pipeline", "devices": "cpu,cpu", "chunks": 4,
     "activation_checkpointing": True},  # except_last recomputation
])
def test_housing_split_trains_the_same_weights_as_single(tmp_path: Path, kw: dict[str, Any]
                                                         ) -> None:
    single = _train(tmp_path, "single", strategy="single")
    split = _train(tmp_path, "split", **kw)
    assert split.summary["strategy"] == kw["strategy"]
    assert isinstance(split.model, SplitModel)
    _close(split.model.state_dict(), single.model.state_dict())
    assert split.summary["steps"] == single.summary["steps"]
    assert split.summary["final"]["test_loss"] == pytest.approx(
        single.summary["final"]["test_loss"], rel=1e-5)
    # the saved file has the plain model's keys and loads into it
    saved = load_file(tmp_path / "split" / "model.safetensors")
    plain = HousingNet(13, out_dim=1)
    plain.load_state_dict(saved, strict=True)
    _close(plain.state_dict(), single.model.state_dict())


def test_pipeline_default_chunks_and_balance_list(tmp_path: Path) -> None:
    result = _train(tmp_path, "p", strategy="pipeline", devices="cpu,cpu", balance="3,2",
                    epochs=1)
    model = result.model
    assert isinstance(model, Pipeline)
    assert model.balance == (3, 2)
    assert model.chunks == default_chunks(8, 2) == 8
    assert model.checkpoint == "never"


def test_chunks_auto_logs_the_sweep_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    result = _train(tmp_path, "auto", strategy="pipeline", devices="cpu,cpu", chunks="auto",
                    epochs=1)
    err = capsys.readouterr().err
    assert "split-size sweep" in err and "median s" in err
    chosen = result.model.chunks
    assert f"chose --chunks {chosen}" in err
    marked = [line for line in err.splitlines() if line.rstrip().endswith("*")]
    assert len(marked) == 1 and int(marked[0].split()[0]) == chosen


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(out)))


class TinyResNet(nn.Module):
    """A residual network with BatchNorm and a sequential view, like the built-in ResNet-50."""

    def __init__(self, classes: int = 3, width: int = 4) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = _Block(width)
        self.layer2 = _Block(width)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer2(self.layer1(self.stem(x))))  # type: ignore[no-any-return]

    def as_sequential(self) -> nn.Sequential:
        return nn.Sequential(self.stem, self.layer1, self.layer2, self.head)


def _image_data() -> Task:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 3, 8, 8, generator=gen)
    y = torch.randint(0, 3, (24,), generator=gen)
    return Task(name="images", build_model=TinyResNet, train=TensorDataset(x, y),
                test=TensorDataset(x[:8], y[:8]), loss=nn.CrossEntropyLoss())


def _loop(model: nn.Module, data: Any, target_device: torch.device | None) -> nn.Module:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    prec = Precision("fp32", "cpu")
    acc = GradAccumulator(model, opt, 1, precision=prec)
    parts = LoopParts(model=model, loss_fn=nn.CrossEntropyLoss(), accumulator=acc,
                      precision=prec, device=torch.device("cpu"), target_device=target_device)
    x, y = data.train.tensors
    batches = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 24, 8)]
    run_epoch(parts, batches, TrainState(), batches_per_epoch=len(batches))
    return model


@pytest.mark.parametrize(("strategy", "chunks"), [("model", None), ("pipeline", 1)])
def test_resnet_like_split_with_batchnorm_equals_single(strategy: str, chunks: int | None
                                                        ) -> None:
    """Whole batches through every stage: BatchNorm sees the same rows as in one device.
    (A pipeline with M > 1 normalises per micro-batch, so it differs by design.)"""
    data = _image_data()
    torch.manual_seed(0)
    single = _loop(TinyResNet(), data, None)
    torch.manual_seed(0)
    config = TrainConfig(strategy=strategy, devices="cpu,cpu", chunks=chunks, batch_size=8)
    split = build_split_model(TinyResNet(), data, config, torch.device("cpu"))
    assert isinstance(split, SplitModel) and len(split.devices) == 2
    _loop(split, data, split.output_device)
    _close(split.state_dict(), single.state_dict())  # weights and BN running statistics
    got = evaluate(split, [data.test.tensors], nn.CrossEntropyLoss(),
                   device=torch.device("cpu"), target_device=split.output_device,
                   metrics={"accuracy": Accuracy()})
    want = evaluate(single, [data.test.tensors], nn.CrossEntropyLoss(),
                    device=torch.device("cpu"), metrics={"accuracy": Accuracy()})
    assert got.loss == pytest.approx(want.loss, rel=1e-5)
    assert got.metrics["accuracy"] == want.metrics["accuracy"]


def test_the_loop_moves_labels_to_target_device() -> None:
    seen: list[torch.device] = []

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        seen.append(y.device)
        return ((out - y.to(out.device)) ** 2).mean()

    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parts = LoopParts(model=model, loss_fn=loss_fn,
                      accumulator=GradAccumulator(model, opt, 1), precision=Precision("fp32"),
                      device=torch.device("cpu"), target_device=torch.device("meta"))
    with pytest.raises(Exception):  # noqa: B017 - the meta label cannot meet a CPU output
        run_epoch(parts, [(torch.ones(2, 2), torch.ones(2, 1))], TrainState(),
                  batches_per_epoch=1)
    assert seen == [torch.device("meta")]


BAD = [
    ({"strategy": "model", "devices": "cpu"}, "one device"),
    ({"strategy": "ddp", "devices": "cpu,cpu"}, "--devices cpu,cpu"),
    ({"strategy": "pipeline", "devices": "cpu,cpu", "schedule": "1f1b"}, "--nproc"),
    ({"strategy": "single", "schedule": "gpipe"}, "--schedule gpipe"),
    ({"strategy": "pipeline", "schedule": "zigzag"}, "zigzag"),
    ({"strategy": "pipeline", "nproc": 2, "schedule": "1f1b", "chunks": 1}, "--chunks 2"),
    ({"strategy": "pipeline", "nproc": 2, "schedule": "interleaved1f1b", "chunks": 3},
     "multiple"),
    ({"strategy": "model", "devices": "cpu,cpu", "nproc": 2}, "--nproc"),
    ({"strategy": "pipeline", "devices": "cpu,cpu", "nnodes": 2,
      "rdzv_endpoint": "127.0.0.1:29400"}, "--nnodes 2"),
    ({"strategy": "pipeline", "devices": "cpu,cpu,cpu", "nproc": 2}, "3 devices"),
    ({"strategy": "pipeline", "devices": "cuda:0,cuda:0", "nproc": 2}, "NCCL"),
    ({"strategy": "pipeline", "devices": "cpu,cpu", "device": "cpu"}, "drop --device"),
    ({"strategy": "single", "balance": "3,2"}, "--balance"),
    ({"strategy": "model", "balance": "3,x"}, "3,x"),
    ({"strategy": "model", "balance": "0,5"}, "0 layers"),
    ({"strategy": "pipeline", "devices": "cpu,,cpu"}, "cpu,,cpu"),
    ({"auto_batch_size": True, "effective_batch_size": 64, "accumulate": 2}, "--accumulate"),
    ({"auto_batch_size": True, "strategy": "fsdp"}, "fsdp"),
    ({"auto_batch_size": True, "strategy": "pipeline", "nproc": 2}, "--nproc"),
    ({"strategy": "pipeline", "nproc": 2, "precision": "fp16"}, "inf/NaN"),
]


@pytest.mark.parametrize(("kw", "needle"), BAD)
def test_bad_combinations_are_refused_with_the_value(kw: dict[str, Any], needle: str) -> None:
    with pytest.raises((UsageError, ConfigError)) as error:
        validate(TrainConfig(**kw))
    message = str(error.value)
    assert needle in message and "\n" not in message
    assert error.value.exit_code == 2


def test_good_combinations_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for kw in ({"strategy": "pipeline", "devices": "cuda:0,cuda:0", "chunks": "auto"},
               {"strategy": "pipeline", "nproc": 2, "save_every": 5, "precision": "bf16"},
               {"strategy": "pipeline", "nproc": 2, "schedule": "1f1b", "chunks": 2},
               {"strategy": "pipeline", "nproc": 2, "schedule": "interleaved1f1b", "chunks": 4},
               {"strategy": "model", "devices": "cpu,cpu", "balance": "time"},
               {"auto_batch_size": True, "effective_batch_size": 64}):
        check_config(TrainConfig(**kw))  # type: ignore[arg-type]
    # a torchrun worker gets no --nproc: WORLD_SIZE counts the processes
    monkeypatch.setenv("WORLD_SIZE", "2")
    check_config(TrainConfig(strategy="pipeline", schedule="1f1b", chunks=2))


def test_balance_that_does_not_match_the_model_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BalanceError, match=r"3, 2"):
        _train(tmp_path, "b", strategy="model", devices="cpu,cpu", balance="3,3")
    assert not (tmp_path / "b").exists()


def test_pure_helpers() -> None:
    assert parse_balance("3, 2") == [3, 2] and parse_balance("SIZE") == "size"
    assert default_chunks(16, 2) == 8 and default_chunks(3, 2) == 3
    assert chunk_ok(4, 16, "gpipe", 2, 2) and not chunk_ok(3, 16, "gpipe", 2, 2)
    assert not chunk_ok(1, 16, "1f1b", 2, 2) and not chunk_ok(2, 16, "interleaved1f1b", 4, 8)
    assert chunks_for_rows(8, 20, "gpipe", 2, 2) == 5  # equal micro-batches only
    assert chunks_for_rows(8, 16, "gpipe", 2, 2) == 8
    assert chunks_for_rows(4, 7, "1f1b", 2, 2) is None  # 7 rows: only 1 or 7 chunks
    assert chunks_for_rows(6, 12, "interleaved1f1b", 4, 8) == 4
