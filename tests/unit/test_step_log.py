"""Step records reach metrics.jsonl inside an epoch (--log-every N, or by time without
it), and the file stays what an epoch-end-only run writes: the same lines, none twice
after a resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.procs import run_cli
from tests.step_limit import train_until
from torchgpu.train.config import TrainConfig
from torchgpu.train.outputs import files as outputs
from torchgpu.train.outputs import step_log
from torchgpu.train.outputs.files import MetricsBuffer
from torchgpu.train.runner import train

BASE = {"example": "housing", "data_size": 100, "epochs": 3, "batch_size": 16,
        "progress": "off", "device": "cpu"}
TIMING = ("seconds", "samples_per_s")


def _config(out: Path, **kw: Any) -> TrainConfig:
    return TrainConfig(out=str(out), **{**BASE, **kw})


def _lines(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in TIMING} for x in lines]


def test_step_lines_are_on_disk_before_the_epoch_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read the file each time the run writes inside the epoch: by time (the default,
    here 0 s) every step's line is there at once; with --log-every 2 every second step."""
    seen: list[list[dict[str, Any]]] = []
    write = step_log.StepLog.write

    def watching(self: step_log.StepLog) -> None:
        write(self)
        seen.append(_lines(Path(str(self.path)).parent))

    monkeypatch.setattr(step_log.StepLog, "write", watching)
    monkeypatch.setattr(outputs, "STEP_FLUSH_S", 0.0)
    train(_config(tmp_path / "timed", epochs=1))
    assert [[line["step"] for line in lines] for lines in seen] == [
        list(range(1, k + 1)) for k in range(1, 6)]  # no epoch line yet at any of them
    seen.clear()
    monkeypatch.setattr(outputs, "STEP_FLUSH_S", 1e9)
    train(_config(tmp_path / "every2", epochs=1, log_every=2))
    assert [[line["kind"] for line in lines] for lines in seen] == [["step"] * 2, ["step"] * 4]


def test_the_file_is_the_same_and_a_resume_writes_no_step_twice(tmp_path: Path) -> None:
    ref = train(_config(tmp_path / "ref"))
    assert ref.out_dir is not None
    every = train(_config(tmp_path / "every", log_every=1))
    assert every.out_dir is not None
    assert _lines(every.out_dir) == _lines(ref.out_dir)
    out = tmp_path / "cut"
    train_until(7, _config(out, log_every=2, save_every=3))
    train(_config(out, log_every=2, save_every=3, resume=""))
    assert _lines(out) == _lines(ref.out_dir)


def test_only_agreed_records_are_written() -> None:
    """Under DDP a record past the ranks' last agreement holds this rank's own loss:
    it waits for the next write."""
    buffer = MetricsBuffer(steps=[(1, 0, 1.0), (2, 0, 2.0), (3, 0, 3.0)])
    assert [json.loads(x)["step"] for x in buffer.take_ready(2)] == [1, 2]
    assert buffer.take_ready(2) == []
    buffer.steps[2] = (3, 0, 2.5)  # the agreement replaced it with the global mean
    buffer.steps.append((4, 0, 4.0))
    assert [json.loads(x)["loss"] for x in buffer.take_ready(None)] == [2.5, 4.0]
    assert buffer.take_lines() == [] and buffer.steps == []  # the epoch end: all written


def test_a_crash_mid_epoch_keeps_the_written_lines(tmp_path: Path) -> None:
    """400 training rows at batch 4: 100 steps in the one epoch; the process is killed
    after step 9: the lines of steps 1-8 (written at 2, 4, 6, 8) are on disk."""
    out = tmp_path / "run"
    marker = tmp_path / "crashed"
    args = ["train", "--example", "housing", "--data-size", "500", "--batch-size", "4",
            "--epochs", "1", "--progress", "off", "--device", "cpu", "--out", str(out)]
    env = {"TORCHGPU_FAULT_CRASH_AT_STEP": "9", "TORCHGPU_FAULT_MARKER": str(marker)}
    done = run_cli([*args, "--log-every", "2"], timeout=120, **env)
    assert done.returncode != 0 and marker.exists(), done.stderr[-2000:]
    assert [(x["kind"], x["step"]) for x in _lines(out)] == [("step", s) for s in range(1, 9)]


def test_log_every_is_checked() -> None:
    from torchgpu.errors import ConfigError

    with pytest.raises(ConfigError, match="--log-every 0"):
        train(TrainConfig(**{**BASE, "log_every": 0}))
