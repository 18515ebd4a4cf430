"""OOM back-off in the training loop: the exact back-off sequence, the same weights as a
run started at the smaller micro-batch, non-OOM errors untouched, the "cannot fit" exit,
and the back-offs in the metrics and summary. CPU only: a forward hook raises
``torch.OutOfMemoryError`` when the micro-batch is larger than a limit."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchgpu.accumulate import GradAccumulator
from torchgpu.errors import OutOfMemoryBackoffError
from torchgpu.models import HousingNet
from torchgpu.precision import Precision
from torchgpu.train.loop import epoch as loop
from torchgpu.train.loop.backoff import LoopBackoff
from torchgpu.train.loop.epoch import run_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.state import TrainState

Batches = list[tuple[torch.Tensor, torch.Tensor]]



@pytest.fixture(autouse=True, params=["micro-batch", "step"])
def loss_read(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case with the loss read per micro-batch (the CPU's way) and once per
    optimizer step (an accelerator's: torchgpu.train.loop.loss_reader)."""
    if request.param == "step":
        monkeypatch.setattr(loop, "per_step_optimizer", lambda device, acc: acc.optimizer)

def _data(samples: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(samples, 13, generator=g), torch.randn(samples, 1, generator=g)


def _batches(batch: int, samples: int = 256) -> Batches:
    x, y = _data(samples)
    return list(zip(x.split(batch), y.split(batch), strict=True))


def _limit_hook(limit: int, seen: list[int]) -> Callable[..., None]:
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if not module.training:  # evaluation is not backed off
            return
        n = int(inputs[0].shape[0])
        seen.append(n)
        if n > limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} samples")

    return hook


def _setup(batch: int, accumulate: int, limit: int | None = None,
           backoff: bool = True) -> tuple[nn.Module, LoopParts, list[int]]:
    torch.manual_seed(0)
    model = HousingNet()
    seen: list[int] = []
    if limit is not None:
        model.register_forward_pre_hook(_limit_hook(limit, seen))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    precision = Precision("fp32", "cpu")
    acc = GradAccumulator(model, optimizer, accumulate, precision=precision)
    loop_backoff = (LoopBackoff(model, acc, nn.MSELoss(), batch_size=batch,
                                accumulate=accumulate) if backoff else None)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc, precision=precision,
                      device=torch.device("cpu"), accumulate=accumulate, backoff=loop_backoff)
    return model, parts, seen


def _train(parts: LoopParts, batches: Batches, epochs: int = 2) -> TrainState:
    state = TrainState()
    for epoch in range(epochs):
        state.begin_epoch(epoch)
        run_epoch(parts, batches, state, batches_per_epoch=len(batches))
    return state


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pairs(parts: LoopParts) -> list[tuple[int, int]]:
    assert parts.backoff is not None
    return [(e.previous_micro_batch, e.previous_accumulate) for e in parts.backoff.events] + [
        (e.micro_batch, e.accumulate) for e in parts.backoff.events[-1:]]


def test_backs_off_64x1_to_16x4_and_trains_like_a_run_started_there() -> None:
    model, parts, seen = _setup(64, 1, limit=16)
    state = _train(parts, _batches(64))
    assert _pairs(parts) == [(64, 1), (32, 2), (16, 4)]
    assert seen[:3] == [64, 32, 16]  # the same first batch, retried in smaller pieces
    assert max(seen[3:]) == 16
    assert parts.backoff is not None and parts.backoff.micro_batch == 16
    assert all(e.effective_batch == 64 for e in parts.backoff.events)
    reference, ref_parts, _ = _setup(16, 4, backoff=False)
    ref_state = _train(ref_parts, _batches(16))
    assert state.step == ref_state.step == 8
    for key, value in _weights(reference).items():
        assert torch.equal(_weights(model)[key], value), key
    assert state.step_losses == pytest.approx(ref_state.step_losses, rel=1e-6)
    assert state.samples == ref_state.samples == 512


def test_back_off_mid_window_replays_the_window_and_keeps_the_effective_batch() -> None:
    # Configured 32 x 2: the OOM hits the first batch; 8 x 8 is where it fits.
    model, parts, _ = _setup(32, 2, limit=8)
    state = _train(parts, _batches(32), epochs=1)
    assert _pairs(parts) == [(32, 2), (16, 4), (8, 8)]
    reference, ref_parts, _ = _setup(8, 8, backoff=False)
    ref_state = _train(ref_parts, _batches(8), epochs=1)
    assert state.step == ref_state.step == 4
    for key, value in _weights(reference).items():
        assert torch.equal(_weights(model)[key], value), key


def test_oom_in_a_later_window_replays_only_that_window() -> None:
    torch.manual_seed(0)
    model, parts, _ = _setup(64, 2)
    calls = {"n": 0}

    def late_oom(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        calls["n"] += 1
        if calls["n"] == 3 and int(inputs[0].shape[0]) == 64:  # window 2, first batch
            raise torch.OutOfMemoryError("CUDA out of memory (late)")

    model.register_forward_pre_hook(late_oom)
    state = _train(parts, _batches(64), epochs=1)
    assert _pairs(parts) == [(64, 2), (32, 4)]
    reference, ref_parts, _ = _setup(64, 2, backoff=False)
    ref_state = _train(ref_parts, _batches(64), epochs=1)
    assert state.step == ref_state.step == 2
    # the same samples per step: the weights agree to float tolerance (pieces of 32)
    for key, value in _weights(reference).items():
        torch.testing.assert_close(_weights(model)[key], value, rtol=1e-5, atol=1e-6)
    assert state.step_losses == pytest.approx(ref_state.step_losses, rel=1e-5)


def test_non_oom_errors_are_reraised_untouched() -> None:
    model, parts, _ = _setup(64, 1)
    boom = ValueError("boom: not a memory problem")

    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        raise boom

    model.register_forward_pre_hook(hook)
    with pytest.raises(ValueError) as info:
        _train(parts, _batches(64), epochs=1)
    assert info.value is boom
    assert parts.backoff is not None and parts.backoff.events == []


def test_cannot_fit_at_micro_batch_1_names_the_numbers() -> None:
    _, parts, seen = _setup(8, 1, limit=0)
    with pytest.raises(OutOfMemoryBackoffError) as info:
        _train(parts, _batches(8), epochs=1)
    text = str(info.value)
    assert "micro-batch 1" in text and "8 -> 4 -> 2 -> 1" in text
    assert seen == [8, 4, 2, 1]
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    assert "effective batch 8;" in text


def test_cannot_fit_reports_the_effective_batch_with_accumulation() -> None:
    _, parts, _ = _setup(8, 3, limit=0)
    with pytest.raises(OutOfMemoryBackoffError) as info:
        _train(parts, _batches(8), epochs=1)
    assert "effective batch 24;" in str(info.value)  # 8 per loader batch x 3 accumulated


def _patch_model(monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    from torchgpu.examples import housing

    original = housing.build_model

    def build_model(data: Any) -> nn.Module:
        model = original(data)
        model.register_forward_pre_hook(_limit_hook(limit, []))
        return model

    monkeypatch.setattr(housing, "build_model", build_model)


def test_cli_exits_1_with_a_cannot_fit_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from torchgpu.cli.main import main

    _patch_model(monkeypatch, limit=0)
    code = main(["train", "--example", "housing", "--data-size", "100", "--epochs", "1",
                 "--batch-size", "8", "--device", "cpu", "--strategy", "single",
                 "--progress", "off", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1
    assert "out of memory at micro-batch 1" in err and "8 -> 4 -> 2 -> 1" in err
    assert "Traceback" not in err


def test_train_logs_each_back_off_in_metrics_summary_and_console(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.runner import train

    _patch_model(monkeypatch, limit=4)
    out = tmp_path / "run"
    result = train(TrainConfig(example="housing", data_size=100, epochs=1, batch_size=16,
                               device="cpu", strategy="single", progress="off", out=str(out)))
    backoffs = result.summary["oom_backoffs"]
    assert [(b["micro_batch"], b["accumulate"]) for b in backoffs] == [(8, 2), (4, 4)]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    logged = [x for x in lines if x["kind"] == "oom_backoff"]
    assert [(x["previous_micro_batch"], x["micro_batch"]) for x in logged] == [(16, 8), (8, 4)]
    assert all(x["effective_batch"] == 16 and x["step"] == 1 for x in logged)
    err = capsys.readouterr().err
    assert "out of memory at micro-batch 16" in err and "micro-batch 4 x4" in err
    assert result.state.step == len([x for x in lines if x["kind"] == "step"]) > 0
