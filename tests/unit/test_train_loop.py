"""The training loop and train(): convergence, accumulation, checkpointing flag,
non-finite handling, the stop flag, reproducible epoch order, and the files written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.step_limit import train_until
from torchgpu.accumulate import GradAccumulator
from torchgpu.errors import NonFiniteLossError
from torchgpu.launch.stop_record import StopFlag
from torchgpu.models import HousingNet
from torchgpu.precision import Precision
from torchgpu.train.config import TrainConfig
from torchgpu.train.loop.epoch import run_epoch, start_epoch
from torchgpu.train.loop.parts import LoopParts
from torchgpu.train.observe.progress import NullProgress, PlainProgress, make_progress
from torchgpu.train.outputs.evaluation import evaluate
from torchgpu.train.runner import train
from torchgpu.train.state import TrainState


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(tmp_path: Path, name: str, **kw: object) -> object:
    config = TrainConfig(out=str(tmp_path / name), progress="off", **kw)  # type: ignore[arg-type]
    return train(config)


@pytest.mark.slow
def test_housing_default_reaches_r2_and_writes_every_file(tmp_path: Path) -> None:
    result = train(TrainConfig(out=str(tmp_path / "run"), progress="off"))
    summary = result.summary
    assert summary["final"]["test_r2"] >= 0.8
    out = tmp_path / "run"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if x["kind"] == "step"]
    epochs = [x for x in lines if x["kind"] == "epoch"]
    assert len(steps) == summary["steps"] == result.state.step
    assert [s["step"] for s in steps] == list(range(1, summary["steps"] + 1))
    assert len(epochs) == summary["epochs"] == result.config.epochs
    assert epochs[-1]["test_r2"] == pytest.approx(summary["final"]["test_r2"])
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["strategy"] == "single" and on_disk["devices"][0]["device"] == "cpu"
    assert on_disk["throughput_samples_per_s"] > 0
    assert on_disk["devices"][0]["peak_memory_bytes"] > 0
    assert {"torch", "torchgpu", "python"} <= set(on_disk["versions"])
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    model = HousingNet()
    model.load_state_dict(load_file(out / "model.safetensors"))  # canonical keys, strict
    for key, value in model.state_dict().items():
        assert torch.equal(value, result.model.state_dict()[key])


def test_accumulation_equals_the_big_batch_with_a_partial_last_window(tmp_path: Path) -> None:
    # 80 training rows: batch 8 x 3 micro-batches -> windows of 24, 24, 24 and a last 8,
    # the same samples as batch 24 (3 full batches and a last batch of 8).
    small = _run(tmp_path, "acc", data_size=100, epochs=2, batch_size=8, accumulate=3)
    big = _run(tmp_path, "big", data_size=100, epochs=2, batch_size=24)
    assert small.state.step == big.state.step == 8  # type: ignore[attr-defined]
    for key, value in _weights(big.model).items():  # type: ignore[attr-defined]
        torch.testing.assert_close(_weights(small.model)[key], value, rtol=1e-5, atol=1e-6)  # type: ignore[attr-defined]
    plain = _run(tmp_path, "plain", data_size=100, epochs=2, batch_size=8)
    assert plain.state.step == 20  # type: ignore[attr-defined]


def test_accumulation_equals_the_big_batch_when_the_last_micro_batch_is_short(
    tmp_path: Path,
) -> None:
    # 84 training rows: batch 8 x 3 -> windows 8+8+8 (x3) and a last one of 8+4; batch 24
    # -> 24 (x3) and a last batch of 12, the same samples. Equal weights (4 counted as
    # much as 8) would differ by ~6e-3; weighting by samples makes the steps equal.
    small = _run(tmp_path, "acc", data_size=105, epochs=2, batch_size=8, accumulate=3,
                 strategy="single")
    big = _run(tmp_path, "big", data_size=105, epochs=2, batch_size=24, strategy="single")
    assert small.state.step == big.state.step == 8  # type: ignore[attr-defined]
    assert small.state.samples == big.state.samples == 2 * 84  # type: ignore[attr-defined]
    for key, value in _weights(big.model).items():  # type: ignore[attr-defined]
        torch.testing.assert_close(_weights(small.model)[key], value, rtol=0, atol=1e-6)  # type: ignore[attr-defined]
    assert small.state.step_losses[:3] == pytest.approx(big.state.step_losses[:3], rel=1e-6)  # type: ignore[attr-defined]


def test_activation_checkpointing_flag_is_applied_and_bitwise_equal(tmp_path: Path) -> None:
    plain = _run(tmp_path, "p", data_size=120, epochs=2, batch_size=16)
    ckpt = _run(tmp_path, "c", data_size=120, epochs=2, batch_size=16,
                activation_checkpointing=True)
    assert type(ckpt.model) is not HousingNet  # type: ignore[attr-defined]
    assert isinstance(ckpt.model, HousingNet)  # type: ignore[attr-defined]
    for key, value in _weights(plain.model).items():  # type: ignore[attr-defined]
        assert torch.equal(_weights(ckpt.model)[key], value)  # type: ignore[attr-defined]
    assert ckpt.summary["activation_checkpointing"] is True  # type: ignore[attr-defined]


def _parts(model: nn.Module, loss_fn: object, on_nonfinite: str = "stop",
           steps: int = 1) -> LoopParts:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    precision = Precision("fp32", "cpu")
    acc = GradAccumulator(model, optimizer, steps, precision=precision)
    return LoopParts(model=model, loss_fn=loss_fn, accumulator=acc,  # type: ignore[arg-type]
                     precision=precision, device=torch.device("cpu"), accumulate=steps,
                     on_nonfinite=on_nonfinite)


def _batches(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 13, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


class _PoisonAt:
    """MSE, but the ``at``-th call returns NaN (as a bad batch would)."""

    def __init__(self, at: int) -> None:
        self.calls = 0
        self.at = at

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = nn.functional.mse_loss(out, y)
        return loss * float("nan") if self.calls == self.at else loss


def test_nonfinite_stop_raises_before_the_weights_change() -> None:
    torch.manual_seed(0)
    model = HousingNet()
    parts = _parts(model, _PoisonAt(3))
    state = TrainState()
    seen: list[dict[str, torch.Tensor]] = []
    with pytest.raises(NonFiniteLossError) as info:
        run_epoch(parts, _batches(), state, batches_per_epoch=6,
                  on_step=lambda s: seen.append(_weights(model)))
    assert "step 3" in str(info.value) and "rank 0" in str(info.value)
    assert state.step == 2
    after = _weights(model)
    assert all(torch.equal(after[k], seen[-1][k]) for k in after)
    assert all(torch.isfinite(v).all() for v in after.values())


def test_nonfinite_skip_drops_the_step_and_counts_it() -> None:
    torch.manual_seed(0)
    model = HousingNet()
    parts = _parts(model, _PoisonAt(3), on_nonfinite="skip", steps=2)
    state = TrainState()
    run_epoch(parts, _batches(), state, batches_per_epoch=6)
    # windows {1,2} step; {3 (NaN), 4}: the NaN drops the window, 4 opens a new one with 5;
    # 6 alone closes the epoch's last window.
    assert state.skipped_steps == 1
    assert state.step == 3
    assert all(torch.isfinite(v).all() for v in _weights(model).values())


def test_stop_flag_ends_the_epoch_at_a_step_boundary() -> None:
    model = HousingNet()
    parts = _parts(model, nn.MSELoss(), steps=2)
    state = TrainState()
    stop = StopFlag()

    def after_step(s: TrainState) -> None:
        if s.step == 2:
            stop.set("test")

    totals = run_epoch(parts, _batches(), state, batches_per_epoch=6, stop=stop,
                       on_step=after_step)
    assert totals.stopped and state.step == 2 and state.batch_in_epoch == 4
    assert parts.accumulator.pending == 0


def test_epoch_order_depends_only_on_seed_and_epoch() -> None:
    from torchgpu.data import make_loader
    from torchgpu.train.strategies.shard import Shard

    data = torch.utils.data.TensorDataset(torch.arange(40.0).unsqueeze(1), torch.zeros(40, 1))

    def order(epoch: int, skip: int = 0) -> list[float]:
        loader = make_loader(data, 5, shuffle=True, seed=3, dist=Shard(0, 1))
        return [float(v) for x, _ in start_epoch(loader, 3, epoch, skip) for v in x.flatten()]

    first = order(1)
    assert order(1) == first and order(2) != first
    assert sorted(first) == [float(v) for v in range(40)]
    assert order(1, skip=3) == first[15:]


def test_evaluate_computes_r2_and_accuracy() -> None:
    from torchgpu.train.metrics import R2, Accuracy

    x = torch.randn(30, 1)
    perfect = evaluate(nn.Identity(), [(x, x.clone())], nn.MSELoss(),
                       device=torch.device("cpu"), metrics={"r2": R2()})
    assert perfect.loss == 0.0 and perfect.metrics["r2"] == pytest.approx(1.0)
    mean_only = evaluate(nn.Identity(), [(torch.full((30, 1), float(x.mean())), x)],
                         nn.MSELoss(), device=torch.device("cpu"), metrics={"r2": R2()})
    assert mean_only.metrics["r2"] == pytest.approx(0.0, abs=1e-6)
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [2.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 0])
    result = evaluate(nn.Identity(), [(logits, labels)], nn.CrossEntropyLoss(),
                      device=torch.device("cpu"), metrics={"accuracy": Accuracy()})
    assert result.metrics == {"accuracy": 0.75} and math.isfinite(result.loss)


def test_only_rank_zero_shows_progress(capsys: pytest.CaptureFixture[str]) -> None:
    assert isinstance(make_progress("auto", is_main=False), NullProgress)
    assert type(make_progress("plain", is_main=False)) is NullProgress
    assert type(make_progress("auto", is_main=True)) is PlainProgress  # stdout is no TTY here
    assert type(make_progress("off", is_main=True)) is NullProgress


def test_rank_other_than_zero_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    from torchgpu.train import runner

    real = runner._Run.__init__

    def as_rank_one(self: object, *args: object, **kwargs: object) -> None:
        args_list = list(args)
        args_list[5] = None  # out_dir: what a rank other than 0 gets
        real(self, *args_list, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner._Run, "__init__", as_rank_one)
    result = train(TrainConfig(out=str(tmp_path / "r1"), data_size=60, epochs=1,
                               progress="plain"))
    assert result.out_dir is None and result.state.step > 0
    assert not (tmp_path / "r1").exists()
    assert capsys.readouterr().out == ""


def test_a_stop_after_the_last_step_stops_nothing(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A signal landing during the last evaluation: the run has finished, so the summary
    must not claim an early stop (nor name a stop step)."""
    from torchgpu.train.strategies import run_steps

    stop = StopFlag()
    real = run_steps.evaluate

    def evaluate_then_signal(*args: object, **kwargs: object) -> object:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        stop.set("SIGTERM")
        return result

    monkeypatch.setattr(run_steps, "evaluate", evaluate_then_signal)
    config = TrainConfig(out=str(tmp_path / "run"), data_size=60, epochs=1, progress="off")
    result = train(config, stop=stop)
    assert result.summary["epochs"] == 1 and stop.is_set()
    assert not result.summary["stopped_early"] and result.summary["stop_reason"] is None
    assert result.summary["stopped_at_step"] is None


def test_a_stop_reports_its_step(tmp_path: Path) -> None:
    config = TrainConfig(out=str(tmp_path / "run"), data_size=60, epochs=3, progress="off")
    result = train_until(2, config)
    summary = result.summary
    assert summary["stopped_early"] and summary["stop_reason"] == "step limit"
    assert summary["stopped_at_step"] == 2 == summary["steps"]
    assert summary["stop_steps_by_rank"] == [2]


def test_a_stop_agreed_at_the_last_step_finishes_the_run(tmp_path: Path) -> None:
    """A stop that lands during the last epoch's last step: every step is done, so the
    last epoch is evaluated and the run is not reported as stopped early."""
    config = TrainConfig(out=str(tmp_path / "run"), data_size=60, epochs=2, progress="off")
    full = train(TrainConfig(out=str(tmp_path / "full"), data_size=60, epochs=2,
                             progress="off"))
    result = train_until(full.state.step, config)
    assert result.summary["epochs"] == 2 and not result.summary["stopped_early"]
    assert result.summary["final"] == full.summary["final"]


def test_the_model_handed_back_holds_no_gradients(tmp_path: Path) -> None:
    result = train(TrainConfig(out=str(tmp_path / "run"), data_size=60, epochs=1,
                               progress="off"))
    assert all(p.grad is None for p in result.model.parameters())


class _CountingWindow:
    """A strategy's own window (no backward): counts batches, steps every ``steps``."""

    def __init__(self, steps: int) -> None:
        self.steps, self.pending, self.window_samples = steps, 0, None
        self.applied = 0
        self.resets = 0

    def set_steps(self, steps: int, window_samples: float | None = None) -> None:
        self.steps = steps

    def zero_grad(self) -> None:
        pass

    def reset(self) -> None:
        self.pending = 0
        self.resets += 1

    def flush(self) -> bool:
        if not self.pending:
            return False
        self.pending, self.applied = 0, self.applied + 1
        return True


def test_a_strategy_s_own_step_replaces_forward_and_backward() -> None:
    # The stage pipeline's branch: the loop calls parts.step per batch (never the model or
    # a backward), sizes its window (the epoch's short last one) and records its losses.
    window = _CountingWindow(2)
    seen: list[int] = []
    values = iter([1.0, 3.0, 2.0, float("nan"), 5.0])

    def step(x: object, y: object, samples: int, loss_fn: object) -> tuple[
            float, bool, bool, None]:
        seen.append(samples)
        value = next(values)
        if not math.isfinite(value):
            return value, True, False, None
        window.pending += 1
        stepped = window.pending >= window.steps and window.flush()
        return value, False, stepped, None

    model = nn.Linear(13, 1)
    forward = model.forward
    model.forward = lambda *a: pytest.fail("the loop ran the model")  # type: ignore[method-assign]
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=window,
                      precision=Precision("fp32", "cpu"), device=torch.device("cpu"),
                      accumulate=2, on_nonfinite="skip", step=step)
    state = TrainState()
    totals = run_epoch(parts, _batches(5), state, batches_per_epoch=5)
    model.forward = forward  # type: ignore[method-assign]
    assert seen == [4] * 5 and totals.micro_batches == 5
    # windows [1, 3] -> step 1 (mean 2); [2, nan] -> skipped; the last window is one batch.
    assert state.step == 2 and state.skipped_steps == 1 and window.resets == 1
    assert state.step_losses == [2.0, 5.0] and window.steps == 2  # restored after the epoch


def test_a_window_without_backward_needs_the_strategy_s_own_step() -> None:
    parts = LoopParts(model=nn.Linear(13, 1), loss_fn=nn.MSELoss(), accumulator=_CountingWindow(1),
                      precision=Precision("fp32", "cpu"), device=torch.device("cpu"))
    with pytest.raises(TypeError, match="runs no backward"):
        run_epoch(parts, _batches(1), TrainState(), batches_per_epoch=1)
