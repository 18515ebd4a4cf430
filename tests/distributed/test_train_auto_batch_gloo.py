"""`torchgpu train --batch-size auto --nproc 2` on two gloo processes whose (simulated)
memories differ: both ranks walk the same probes and train with the smaller rank's
largest micro-batch, and the effective batch is kept with accumulation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import run_cli
from torchgpu.train.hooks.simulated_memory import SIMULATE_ENV


@pytest.mark.slow
def test_ranks_with_different_limits_both_pick_the_minimum(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli(["train", "--example", "housing", "--data-size", "120", "--epochs", "1",
                    "--device", "cpu", "--nproc", "2", "--strategy", "ddp",
                    "--batch-size", "auto", "--effective-batch-size", "44",
                    "--progress", "plain", "--out", str(out)],
                   **{SIMULATE_ENV: "40,11"})
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 1 fits 11, rank 0 fits 40: both use 11; 44 = 11 x 2 accumulation x 2 processes
    assert "largest micro-batch that fits: 11 [" in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["batch_size"], summary["accumulate"]) == (11, 2)
    assert summary["global_batch"] == 44 and summary["world_size"] == 2
    assert summary["config"]["auto_batch_size"] is True
