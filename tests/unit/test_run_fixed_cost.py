"""What a run does besides training, counted rather than timed: metrics.jsonl is fsynced
once, at the run's end, not after every epoch (milliseconds each, a tenth of a second
over the demo's 40 epochs), and its lines are complete and the same as before."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from torchgpu.train.config import TrainConfig
from torchgpu.train.runner import train

BASE = {"example": "housing", "data_size": 100, "epochs": 4, "batch_size": 16,
        "progress": "off", "device": "cpu"}


def test_metrics_are_fsynced_once_at_the_end(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    fsync = os.fsync

    def counting(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", counting)
    out = tmp_path / "run"
    train(TrainConfig(out=str(out), **BASE))  # type: ignore[arg-type]
    metrics = str((out / "metrics.jsonl").resolve())
    assert synced.count(metrics) == 1
    # the final files are still each written atomically (fsynced before their rename)
    for name in ("summary.json", "loss.png", "model.safetensors"):
        assert any(os.path.basename(p).startswith(f".{name}.tmp-") for p in synced), name
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [x for x in lines if x["kind"] == "epoch"]
    assert [x["epoch"] for x in epochs] == [0, 1, 2, 3]
    assert [x["step"] for x in lines if x["kind"] == "step"] == list(
        range(1, epochs[-1]["step"] + 1))
