"""--autoresume / fit(autoresume=True): one command for every run of a requeued job. A
stopped run continues bitwise, a corrupt newest checkpoint is skipped for the previous
good one, no checkpoint starts (over), a finished run is nothing to do (exit 0, fit
returns its result), conflicting flags are refused; a fit run's stop message speaks of
fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.procs import run_main
from tests.step_limit import train_until
from torchgpu import fit
from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.outputs.report import TrainResult
from torchgpu.train.runner import train
from torchgpu.train.task import user_task

# 100 samples -> 80 train rows, batch 16 -> 5 steps per epoch, 15 in all.
BASE = {"example": "housing", "data_size": 100, "epochs": 3, "batch_size": 16,
        "progress": "off", "device": "cpu"}
TIMING = ("seconds", "samples_per_s")


def _config(out: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(out=str(out), **{**BASE, **kw})


def _metrics(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in TIMING} for x in lines]


def _same(a: TrainResult, b: TrainResult) -> bool:
    wa, wb = a.model.state_dict(), b.model.state_dict()
    return (wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
            and a.state.step_losses == b.state.step_losses)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    """The uninterrupted run."""
    return train(_config(tmp_path_factory.mktemp("ref") / "run"))


def test_a_stopped_run_continues_bitwise_with_the_same_command(
    tmp_path: Path, reference: TrainResult, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    first = train_until(7, _config(out, autoresume=True, save_every=3))
    assert first.summary["stopped_early"] and first.state.step == 7
    err = capsys.readouterr().err
    assert "no checkpoint in" in err and "starting the run" in err
    assert "run the same command again (--autoresume continues the run)" in err
    again = train(_config(out, autoresume=True, save_every=3))  # the very same settings
    err = capsys.readouterr().err
    assert "--autoresume: continuing the run" in err and "step-00000007" in err
    assert again.summary["checkpoints"]["resumed_from"].endswith("step-00000007")
    assert _same(again, reference)
    assert _metrics(out) == _metrics(reference.out_dir or Path())  # no step twice


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_previous_good_one(
    tmp_path: Path, reference: TrainResult, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    train_until(7, _config(out, save_every=3))  # saves steps 3, 6, 7
    bad = out / "checkpoints" / "step-00000007" / "state.pt"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    capsys.readouterr()
    resumed = train(_config(out, autoresume=True, save_every=3))
    assert resumed.summary["checkpoints"]["resumed_from"] == str(
        out / "checkpoints" / "step-00000006")
    assert "step-00000006" in capsys.readouterr().err
    assert _same(resumed, reference)


def test_half_written_newest_checkpoint_is_skipped(
    tmp_path: Path, reference: TrainResult
) -> None:
    out = tmp_path / "run"
    train_until(7, _config(out, save_every=3))
    (out / "checkpoints" / "step-00000007" / "manifest.json").unlink()  # never committed
    resumed = train(_config(out, autoresume=True))
    assert resumed.summary["checkpoints"]["resumed_from"].endswith("step-00000006")
    assert _same(resumed, reference)


def test_no_checkpoint_starts_and_a_crashed_run_is_started_over(
    tmp_path: Path, reference: TrainResult, capsys: pytest.CaptureFixture[str]
) -> None:
    fresh = train(_config(tmp_path / "new", autoresume=True))
    assert _same(fresh, reference)
    # A run that died before its first checkpoint left some of its files, and a file of
    # the user's: the run's are replaced, the user's is kept.
    out = tmp_path / "crashed"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"kind": "step", "step": 1, "epoch": 0, "loss": 9}\n')
    (out / "config.toml").write_text("epochs = 3\n")
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    started = train(_config(out, autoresume=True))
    err = capsys.readouterr().err
    assert "holds a run with no checkpoint" in err and "metrics.jsonl" in err
    assert _same(started, reference)
    assert _metrics(out) == _metrics(reference.out_dir or Path())
    assert (out / "notes.txt").read_text() == "mine"


def test_a_finished_run_is_nothing_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    argv = ["train", "--example", "housing", "--data-size", "100", "--epochs", "2",
            "--batch-size", "16", "--progress", "off", "--device", "cpu", "--out", str(out),
            "--autoresume"]
    code, _ = run_main(argv, capsys)
    assert code == 0
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    code, err = run_main(argv, capsys)
    assert code == 0
    assert "already finished" in err and "nothing to do" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before  # untouched
    # The same run asking for more epochs: nothing to continue, and it is not deleted.
    code, err = run_main([*argv, "--epochs", "3"], capsys)
    assert code == 2 and "finished run of 2 epochs" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def _lm_settings(tmp_path: Path) -> dict[str, Any]:
    return {"epochs": 2, "batch_size": 8, "seed": 3, "progress": "off", "save_every": 3,
            "out": tmp_path / "run"}


def test_fit_autoresume_continues_and_then_returns_the_finished_result(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.user_models import TokenDataset, lm_factory

    settings = _lm_settings(tmp_path)
    whole = fit(lm_factory, TokenDataset(40), **{**settings, "out": tmp_path / "whole"})
    task = user_task(lm_factory, TokenDataset(40), name="lm_factory")
    config = TrainConfig(model="fit:lm_factory", data="fit:TokenDataset", autoresume=True,
                         **{**settings, "out": str(settings["out"])})
    capsys.readouterr()
    train_until(4, config, task=task)
    err = capsys.readouterr().err
    # A fit user is told about fit, not about command-line flags.
    assert "call fit(...) again as it is (autoresume=True continues the run)" in err
    assert "--resume" not in err
    resumed = fit(lm_factory, TokenDataset(40), autoresume=True, **settings)
    for a, b in zip(whole.model.state_dict().values(), resumed.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    capsys.readouterr()
    done = fit(lm_factory, TokenDataset(40), autoresume=True, **settings)
    assert "nothing to do" in capsys.readouterr().err
    assert done.summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert done.summary["steps"] == resumed.summary["steps"] and len(done.epochs) == 2
    assert done.final is not None and done.final.train_loss == resumed.summary["final"][
        "train_loss"]
    for a, b in zip(whole.model.state_dict().values(), done.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)


def test_a_fit_stop_without_autoresume_names_resume_true(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.user_models import TokenDataset, lm_factory

    settings = _lm_settings(tmp_path)
    config = TrainConfig(model="fit:lm_factory", data="fit:TokenDataset",
                         **{**settings, "out": str(settings["out"])})
    train_until(2, config, task=user_task(lm_factory, TokenDataset(40), name="lm_factory"))
    err = capsys.readouterr().err
    assert "call fit(...) again with resume=True" in err and "--resume" not in err


@pytest.mark.parametrize(("extra", "words"), [
    ({"resume": ""}, "--autoresume and --resume were both given"),
    ({"overwrite": True}, "--autoresume and --overwrite were both given"),
    ({"out": None}, "--autoresume needs --out"),
])
def test_conflicting_or_missing_flags_are_refused(
    tmp_path: Path, extra: dict[str, Any], words: str
) -> None:
    config = TrainConfig(**{**BASE, "out": str(tmp_path / "run"), "autoresume": True, **extra})
    with pytest.raises(UsageError, match=words):
        train(config)
    assert not (tmp_path / "run").exists()


def test_cli_refuses_autoresume_without_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--example", "housing", "--autoresume"], capsys)
    assert code == 2 and "--autoresume needs --out" in err
    assert not (tmp_path / "runs").exists()


LONG = ["train", "--example", "housing", "--data-size", "100", "--batch-size", "16",
        "--epochs", "150", "--progress", "off", "--device", "cpu", "--save-every", "40"]


@pytest.mark.slow
def test_sigterm_then_the_same_command_continues_bitwise(tmp_path: Path) -> None:
    """A real SIGTERM to the CLI (the job's time ran out): it saves and exits 0; the
    requeued, identical command continues and ends with the uninterrupted run's weights."""
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    from tests.procs import run_cli, test_env
    from torchgpu.cli.main import main

    # the uninterrupted reference in this process (no start-up of its own), as
    # test_resume's long_reference
    assert main([*LONG, "--out", str(tmp_path / "ref")]) == 0
    out = tmp_path / "job"
    job = [*LONG, "--out", str(out), "--autoresume"]
    proc = subprocess.Popen([sys.executable, "-m", "torchgpu", *job], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=test_env())
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "latest").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(proc.communicate()[1][-2000:])
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "stopped by SIGTERM" in err and "run the same command again" in err
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stopped_early"] and stopped["steps"] < 750
    again = run_cli(job, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"step-{stopped['steps']:08d}" in again.stderr
    a, b = load_file(out / "model.safetensors"), load_file(tmp_path / "ref" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(out) == _metrics(tmp_path / "ref")
