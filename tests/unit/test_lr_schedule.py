"""Learning-rate schedules (``--lr-schedule``, ``--warmup-steps``, ``--lr-step-size``,
``--lr-gamma``, ``--scheduler`` and ``fit(scheduler=...)``): their shapes against Hugging
Face's formulas, one scheduler step per applied optimizer step, exact save and restore,
the step records and the plot, and bad input refused before anything is written."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from torch import nn
from torch.utils.data import TensorDataset

from tests.step_limit import train_until
from torchgpu import fit
from torchgpu.cli.main import main
from torchgpu.errors import UsageError
from torchgpu.examples import housing
from torchgpu.train import schedule
from torchgpu.train.config import TrainConfig
from torchgpu.train.runner import train

# 100 samples -> 80 train rows; batch 16 -> 5 micro-batches per epoch.
BASE: dict[str, Any] = {"example": "housing", "data_size": 100, "batch_size": 16,
                        "progress": "off", "device": "cpu", "strategy": "single"}
CLI = ["--data-size", "100", "--batch-size", "16", "--device", "cpu", "--strategy", "single",
       "--progress", "off"]


def _config(out: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(out=str(out), **{**BASE, **kw})


def _steps(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if x["kind"] == "step"]


# -- the shapes -------------------------------------------------------------------------

# W = 10 warm-up steps of T = 110; the step schedule: 20 steps per epoch, decay by 0.5
# every 2 epochs. Steps: 0 (start), 5 (mid warm-up), 10 (warm-up end), 60 (middle of
# the decay), 110 (end).
TABLE = [
    ("constant", [0.0, 0.5, 1.0, 1.0, 1.0]),
    ("linear", [0.0, 0.5, 1.0, 0.5, 0.0]),
    ("cosine", [0.0, 0.5, 1.0, 0.5, 0.0]),
    ("step", [0.0, 0.5, 1.0, 0.5 ** 1, 0.5 ** 2]),  # epochs 3 and 5
]


@pytest.mark.parametrize(("kind", "expected"), TABLE)
def test_factor_at_start_warmup_middle_and_end(kind: str, expected: list[float]) -> None:
    got = [schedule.factor(kind, t, warmup=10, total=110, steps_per_epoch=20, step_size=2,
                           gamma=0.5) for t in (0, 5, 10, 60, 110)]
    assert got == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_lambda_lr_matches_hugging_face_at_every_step(kind: str) -> None:
    """The LR the built-in LambdaLR gives each step equals transformers'
    get_{kind}_schedule_with_warmup on the same optimizer."""
    transformers = pytest.importorskip("transformers")
    total, warmup = 37, 6
    reference = {"constant": transformers.get_constant_schedule_with_warmup,
                 "linear": transformers.get_linear_schedule_with_warmup,
                 "cosine": transformers.get_cosine_schedule_with_warmup}[kind]

    def lrs(make: Any) -> list[float]:
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.3)
        scheduler = make(optimizer)
        seen = []
        for _ in range(total + 1):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    config = TrainConfig(lr_schedule=kind, warmup_steps=warmup, epochs=1)
    ours = lrs(lambda o: schedule.built_in(config, o, total, total))
    theirs = lrs(lambda o: reference(o, warmup) if kind == "constant"
                 else reference(o, warmup, total))
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("base", [1.0, 0.3])
def test_step_schedule_is_torchs_step_lr_per_epoch_bitwise(base: float) -> None:
    """torch/examples' StepLR(step_size=1, gamma=0.7) stepped once per epoch, against the
    built-in step schedule stepped once per optimizer step (3 a epoch): the same LR at
    every step of 8 epochs, to the last bit (0.7 ** 4 is not 0.7 * 0.7 * 0.7 * 0.7)."""
    per_epoch, epochs = 3, 8
    torch_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    step_lr = torch.optim.lr_scheduler.StepLR(torch_opt, step_size=1, gamma=0.7)
    expected = []
    for _ in range(epochs):
        expected += [torch_opt.param_groups[0]["lr"]] * per_epoch
        torch_opt.step()
        step_lr.step()
    ours_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    config = TrainConfig(lr_schedule="step", lr_gamma=0.7, epochs=epochs)
    scheduler = schedule.built_in(config, ours_opt, per_epoch * epochs, per_epoch)
    got = []
    for _ in range(per_epoch * epochs):
        got.append(ours_opt.param_groups[0]["lr"])
        ours_opt.step()
        scheduler.step()
    assert got == expected


# -- the engine steps it once per applied optimizer step --------------------------------

@pytest.mark.parametrize("accumulate", [1, 2])
def test_one_scheduler_step_per_optimizer_step_with_accumulation(
        tmp_path: Path, accumulate: int) -> None:
    """5 micro-batches per epoch: 5 optimizer steps, or 3 with --accumulate 2 (windows of
    2, 2, 1). The linear decay runs over exactly those steps, so the LR of step t (from
    1) is lr * (T - t + 1) / T: a step per micro-batch would reach 0 too early."""
    result = train(_config(tmp_path / "run", epochs=2, accumulate=accumulate, lr=0.01,
                           lr_schedule="linear"))
    total = 2 * math.ceil(5 / accumulate)
    assert result.state.step == total
    expected = [0.01 * (total - t) / total for t in range(total)]
    assert result.state.step_lrs == pytest.approx(expected, rel=1e-12)
    assert [x["lr"] for x in _steps(tmp_path / "run")] == pytest.approx(expected, rel=1e-12)


def test_batch_size_auto_decays_over_the_steps_of_the_effective_batch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The searched micro-batch (at most 6 samples here) is accumulated to the effective
    batch of 16: the linear decay spans the 64 / 16 = 4 optimizer steps of each epoch."""
    from tests.user_models import TokenDataset, lm_factory

    monkeypatch.setenv("TORCHGPU_SIMULATE_MEMORY_LIMIT_SAMPLES", "6")
    result = fit(lm_factory, TokenDataset(64), epochs=2, batch_size="auto",
                 effective_batch_size=16, lr=0.01, lr_schedule="linear",
                 out=tmp_path / "run", progress="off", device="cpu")
    assert result.summary["accumulate"] > 1 and result.state.step == 8
    assert result.state.step_lrs == pytest.approx([0.01 * (8 - t) / 8 for t in range(8)])


def test_oom_backoff_replays_do_not_step_the_scheduler() -> None:
    """A back-off replays the window at half the micro-batch: still one optimizer step,
    so one scheduler step (the loop's on_step, as the runner hooks it)."""
    from torchgpu.accumulate import GradAccumulator
    from torchgpu.models import HousingNet
    from torchgpu.precision import Precision
    from torchgpu.train.loop.backoff import LoopBackoff
    from torchgpu.train.loop.epoch import run_epoch
    from torchgpu.train.loop.parts import LoopParts
    from torchgpu.train.state import TrainState

    def over_limit(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        if module.training and inputs[0].shape[0] > 10:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    torch.manual_seed(0)
    model = HousingNet()
    model.register_forward_pre_hook(over_limit)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = GradAccumulator(model, optimizer, 2, precision=Precision("fp32", "cpu"))
    backoff = LoopBackoff(model, acc, nn.MSELoss(), batch_size=32, accumulate=2)
    parts = LoopParts(model=model, loss_fn=nn.MSELoss(), accumulator=acc,
                      precision=Precision("fp32", "cpu"), device=torch.device("cpu"),
                      accumulate=2, backoff=backoff)
    x, y = torch.randn(256, 13), torch.randn(256, 1)
    batches = list(zip(x.split(32), y.split(32), strict=True))  # 8 micro-batches, 4 steps
    scheduler = schedule.built_in(TrainConfig(lr_schedule="linear", epochs=2), optimizer,
                                  total=8, steps_per_epoch=4)
    state, hook = TrainState(), schedule.step_hook(optimizer, scheduler, None)
    for epoch in range(2):
        state.begin_epoch(epoch)
        run_epoch(parts, batches, state, batches_per_epoch=len(batches), on_step=hook)
    assert backoff.events  # it did back off (32 -> 16 -> 8)
    assert state.step == scheduler.last_epoch == 8
    assert state.step_lrs == pytest.approx([0.1 * (8 - t) / 8 for t in range(8)])


def test_a_skipped_nonfinite_step_does_not_step_the_scheduler(tmp_path: Path) -> None:
    """--on-nonfinite skip drops a step: the schedule advances only on applied steps."""
    torch.manual_seed(0)
    x, y = torch.randn(40, 3), torch.randn(40, 1)
    x[7, 0] = math.nan  # one batch of 8 has a NaN loss every epoch
    result = fit(nn.Linear(3, 1), TensorDataset(x, y), loss=nn.MSELoss(), epochs=3,
                 batch_size=8, lr=0.1, lr_schedule="linear", on_nonfinite="skip",
                 out=tmp_path / "run", progress="off", device="cpu")
    state = result.state
    assert state.skipped_steps == 3 and state.step == 12
    total = 15  # the planned steps: 5 per epoch
    assert state.step_lrs == pytest.approx([0.1 * (total - t) / total for t in range(12)])


def test_warmup_longer_than_the_run_is_allowed_with_a_warning(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = train(_config(tmp_path / "run", epochs=1, lr=0.01, warmup_steps=50))
    assert "--warmup-steps 50 is longer than the run's 5 optimizer steps" in (
        capsys.readouterr().err)
    assert result.state.step_lrs == pytest.approx([0.01 * t / 50 for t in range(5)])


def test_without_a_schedule_there_is_no_scheduler_and_the_lr_is_recorded(
        tmp_path: Path) -> None:
    result = train(_config(tmp_path / "run", epochs=1, lr=0.01, save_every=5))
    assert result.state.step_lrs == [0.01] * 5
    assert [x["lr"] for x in _steps(tmp_path / "run")] == [0.01] * 5
    state = torch.load(tmp_path / "run" / "checkpoints" / "step-00000005" / "state.pt",
                       weights_only=True)
    assert state["scheduler"] is None  # checkpoints stay what they were without one


# -- saved and restored exactly ---------------------------------------------------------

def _dropout_model(data: Any) -> nn.Module:
    return nn.Sequential(nn.Linear(data.input_shape[0], 32), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(32, data.num_outputs))


def _step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


@pytest.mark.parametrize(("settings", "factory"), [
    ({"lr_schedule": "cosine", "warmup_steps": 3, "accumulate": 2}, None),
    ({"lr_schedule": "step", "lr_step_size": 1, "lr_gamma": 0.7}, None),
    ({}, _step_lr),
])
def test_stop_and_resume_with_a_schedule_is_bitwise_identical(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any],
        factory: Any) -> None:
    monkeypatch.setattr(housing, "build_model", _dropout_model)
    from torchgpu.examples import task_for
    from torchgpu.train.config import resolve

    def run(out: Path, stop_at: int | None = None, **kw: Any) -> Any:
        config = _config(out, epochs=3, lr=0.01, **settings, **kw)
        task = None
        if factory is not None:
            import dataclasses

            task = dataclasses.replace(task_for(resolve(config)), scheduler=factory)
        return train_until(stop_at, config, task=task)

    whole = run(tmp_path / "whole")
    # Step 5: mid-epoch with --accumulate 2; between two decays of the StepLR.
    first = run(tmp_path / "cut", save_every=100, stop_at=5)
    assert first.state.step == 5 and first.summary["stopped_early"]
    resumed = run(tmp_path / "cut", resume="")
    assert resumed.state.step_lrs == whole.state.step_lrs
    assert len(set(whole.state.step_lrs)) > 2  # the schedule did change the LR
    a, b = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    timing = ("seconds", "samples_per_s")

    def lines(out: Path) -> list[dict[str, Any]]:
        return [{k: v for k, v in json.loads(x).items() if k not in timing}
                for x in (out / "metrics.jsonl").read_text().splitlines()]

    assert lines(tmp_path / "cut") == lines(tmp_path / "whole")  # lr included


def test_resume_with_another_schedule_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    train_until(3, _config(out, epochs=2, lr_schedule="cosine"))
    code = main(["train", *CLI, "--epochs", "2", "--lr-schedule", "linear", "--resume",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "lr_schedule 'cosine' -> 'linear'" in err, err


# -- the command line, outputs and bad input --------------------------------------------

SCHEDULERS = '''
import torch


def halve_each_step(optimizer):
    return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)


def not_a_scheduler(optimizer):
    return [optimizer]


def fails(optimizer):
    raise ValueError("no such thing")


def on_a_metric(optimizer):
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def of_another_optimizer(optimizer):
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return torch.optim.lr_scheduler.StepLR(other, 1)
'''


def _spec(tmp_path: Path) -> str:
    path = tmp_path / "schedulers.py"
    path.write_text(SCHEDULERS)
    return str(path)


def test_cli_step_schedule_in_epochs_records_and_plots(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, flat = tmp_path / "run", tmp_path / "flat"
    assert main(["train", *CLI, "--epochs", "3", "--lr", "0.01", "--lr-schedule", "step",
                 "--lr-step-size", "1", "--lr-gamma", "0.5", "--out", str(out)]) == 0
    assert main(["train", *CLI, "--epochs", "3", "--lr", "0.01", "--out", str(flat)]) == 0
    capsys.readouterr()
    assert [x["lr"] for x in _steps(out)] == pytest.approx([0.01] * 5 + [0.005] * 5
                                                           + [0.0025] * 5)
    written = (out / "config.toml").read_text()
    assert 'lr_schedule = "step"' in written and "lr_gamma = 0.5" in written
    # The plot gains a learning-rate panel under the loss chart when the LR changed.
    with Image.open(out / "loss.png") as image, Image.open(flat / "loss.png") as plain:
        assert image.height > plain.height and image.width == plain.width


def test_cli_scheduler_spec_is_used(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", *CLI, "--epochs", "1", "--lr", "0.01", "--scheduler",
                 f"{_spec(tmp_path)}:halve_each_step", "--out", str(out)]) == 0
    capsys.readouterr()
    assert [x["lr"] for x in _steps(out)] == pytest.approx([0.01 / 2 ** t for t in range(5)])


def test_fit_scheduler_factory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    result = fit(nn.Linear(3, 1), data, loss=nn.MSELoss(), epochs=1, batch_size=8, lr=0.1,
                 scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, gamma=0.1),
                 out=tmp_path / "run", progress="off", device="cpu")
    assert result.state.step_lrs == pytest.approx([0.1, 0.1, 0.01, 0.01])


@pytest.mark.parametrize(("flags", "needle"), [
    (["--lr-schedule", "bogus"], "unknown lr_schedule 'bogus': allowed are constant, "
     "linear, cosine, step"),
    (["--warmup-steps", "-1"], "--warmup-steps -1 is out of range: it must be >= 0"),
    (["--lr-gamma", "0.5"], "--lr-gamma 0.5 only apply to --lr-schedule step"),
    (["--lr-schedule", "step", "--lr-step-size", "0"], "--lr-step-size 0 is out of range"),
    (["--lr-schedule", "step", "--lr-gamma", "nan"], "--lr-gamma nan must be a positive"),
    (["--scheduler", "{spec}:not_a_scheduler"],
     "the scheduler factory --scheduler {spec}:not_a_scheduler returned a list, not a "
     "learning-rate scheduler"),
    (["--scheduler", "{spec}:fails"], "failed on the run's optimizer (ValueError: no such"),
    (["--scheduler", "{spec}:on_a_metric"], "returned a ReduceLROnPlateau, which steps on"),
    (["--scheduler", "{spec}:of_another_optimizer"], "of another optimizer"),
    (["--scheduler", "{spec}:missing"], "has no attribute 'missing'"),
    (["--scheduler", "{spec}:halve_each_step", "--lr-schedule", "cosine"],
     "and --lr-schedule cosine were both given"),
])
def test_bad_schedule_input_exits_2_in_one_paragraph_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
        needle: str) -> None:
    spec, out = _spec(tmp_path), tmp_path / "run"
    code = main(["train", *CLI, "--epochs", "1", *[f.format(spec=spec) for f in flags],
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle.format(spec=spec) in " ".join(err.split()), err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 2, err
    assert not out.exists()


def test_fit_refuses_a_scheduler_object(tmp_path: Path) -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(UsageError, match="StepLR"):
        fit(nn.Linear(3, 1), TensorDataset(torch.randn(8, 3), torch.randn(8, 1)),
            loss=nn.MSELoss(), scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1),
            out=tmp_path / "run", progress="off")
    assert not (tmp_path / "run").exists()
