"""A loss that fails only in evaluation, under the multi-process stage pipeline (two gloo
processes on 127.0.0.1): the last stage computes the held-out loss, so its failure must
reach the other stage, and both save the trained epoch together instead of waiting for
each other; `--resume` with a loss that works then evaluates that epoch and finishes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import REPO, run_cli
from torchgpu.checkpoint import verify_checkpoint

# 70 rows in batches of 8, windows of 2: 5 steps per epoch.
RUN = ["train", "--model", "tests.stage_models:dropout_bn", "--data",
       "tests.stage_models:regression", "--strategy", "pipeline", "--nproc", "2",
       "--balance", "4,4", "--chunks", "2", "--epochs", "2", "--batch-size", "8",
       "--accumulate", "2", "--progress", "plain", "--collective-timeout", "30"]


@pytest.mark.slow
def test_a_loss_failing_on_the_last_stage_keeps_the_epoch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    failed = run_cli([*RUN, "--loss", "tests.user_models:training_only_mse", "--out",
                      str(out)], timeout=240, cwd=REPO)
    err = " ".join(failed.stderr.split())
    assert failed.returncode != 0, err[-3000:]
    assert "the evaluation after epoch 1 of 2 (step 5) failed" in err, err[-3000:]
    assert "Traceback" not in err and "hung" not in err
    verify_checkpoint(out / "checkpoints" / "step-00000005")
    resumed = run_cli([*RUN, "--loss", "mse", "--resume", "--out", str(out)], timeout=240,
                      cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 10
    assert summary["checkpoints"]["resumed_from"].endswith("step-00000005")
