"""--log tensorboard: event files hold the run's step losses (read back with TensorBoard's
own reader) and epoch metrics; a missing tensorboard is refused before anything is
written; importing torchgpu never imports tensorboard."""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.procs import run_main
from torchgpu.errors import ConfigError
from torchgpu.train.config import TrainConfig
from torchgpu.train.observe.tensorboard import TB_DIR
from torchgpu.train.runner import train


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
            for tag in accumulator.Tags()["scalars"]}


def test_event_files_hold_the_step_losses_and_epoch_metrics(tmp_path: Path) -> None:
    result = train(TrainConfig(example="housing", data_size=96, epochs=2, batch_size=16,
                               device="cpu", out=str(tmp_path), progress="off",
                               log="tensorboard"))
    scalars = _scalars(tmp_path / TB_DIR)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [(r["step"], r["loss"]) for r in lines if r["kind"] == "step"]
    epochs = [r for r in lines if r["kind"] == "epoch"]
    assert len(steps) == result.summary["steps"] > 0
    logged = scalars["train/loss"]
    assert [s for s, _ in logged] == [s for s, _ in steps]
    assert [v for _, v in logged] == pytest.approx([v for _, v in steps], rel=1e-6)
    assert [v for _, v in scalars["test/loss"]] == pytest.approx(
        [e["test_loss"] for e in epochs], rel=1e-6)
    assert [s for s, _ in scalars["test/r2"]] == [e["step"] for e in epochs]
    assert len(scalars["throughput/samples_per_s"]) == 2
    assert all(v > 0 for _, v in scalars["memory/peak_bytes"])
    assert result.summary["files"]["tensorboard"] == str(tmp_path / TB_DIR)


def test_default_log_writes_no_event_files(tmp_path: Path) -> None:
    train(TrainConfig(example="housing", data_size=64, epochs=1, device="cpu",
                      out=str(tmp_path), progress="off"))
    assert (tmp_path / "metrics.jsonl").is_file() and not (tmp_path / TB_DIR).exists()


def test_missing_tensorboard_refused_before_writing(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == "tensorboard" else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"torchgpu\[tensorboard\]"):
        train(TrainConfig(example="housing", data_size=64, epochs=1, device="cpu",
                          out=str(out), progress="off", log="tensorboard"))
    assert not out.exists()


def test_unknown_log_format_refused() -> None:
    from torchgpu.train.config_checks import validate

    with pytest.raises(ConfigError, match="unknown log 'csv'"):
        validate(TrainConfig(log="csv"))


def test_importing_torchgpu_does_not_import_tensorboard() -> None:
    code = ("import sys, torchgpu, torchgpu.train.runner, torchgpu.cli.train; "
            "print(sorted(m for m in sys.modules if 'tensorboard' in m))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"


@pytest.fixture
def no_data_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run gets as far as loading the housing example's data."""
    from torchgpu.examples import housing

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("data was loaded before the bad --log tensorboard was refused")

    monkeypatch.setattr(housing, "load", refuse)


def _deny_inside(monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
    """Making anything inside ``directory`` fails as in a read-only directory for a
    non-root user (these tests run as root, whom a chmod does not stop)."""
    real_mkdir, real_open = os.mkdir, os.open

    def denied(path: Any) -> bool:
        return Path(os.fspath(path)).parent == directory

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if denied(path):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        real_mkdir(path, *args, **kwargs)

    def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if denied(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)


def test_read_only_tensorboard_directory_refused_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_data_loading: None) -> None:
    out = tmp_path / "run"
    (out / TB_DIR).mkdir(parents=True)
    _deny_inside(monkeypatch, out / TB_DIR)
    code, err = run_main(["train", "--example", "housing", "--epochs", "1", "--out", str(out),
                          "--log", "tensorboard", "--progress", "off"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert str(out / TB_DIR) in err and "permission denied" in err and "--log" in err
    assert sorted(p.name for p in out.iterdir()) == [TB_DIR]  # nothing written
    assert list((out / TB_DIR).iterdir()) == []


def test_tensorboard_that_fails_on_import_refused_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_data_loading: None) -> None:
    """An installed but broken tensorboard (here: a protobuf mismatch, a common one)."""
    broken = tmp_path / "site" / "tensorboard"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "raise TypeError('Descriptors cannot be created directly.')\n")
    for name in [m for m in sys.modules
                 if m.split(".")[0] == "tensorboard" or m.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(broken.parent))
    out = tmp_path / "run"
    code, err = run_main(["train", "--example", "housing", "--epochs", "1", "--out", str(out),
                          "--log", "tensorboard", "--progress", "off"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Descriptors cannot be created directly" in err
    assert "pip install tensorboard" in err and "drop --log tensorboard" in err
    assert not out.exists()
