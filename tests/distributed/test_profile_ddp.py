"""`--profile` under DDP on 2 gloo processes: the phase shares count each moment once
(they add up to 100 %, "other" included), the step's wait for the gradient all-reduce is
communication, and the loss counts with the forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import run_cli

pytestmark = pytest.mark.slow


def test_ddp_profile_shares_add_up_and_show_communication(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = run_cli(["train", "--example", "housing", "--data-size", "200", "--batch-size", "8",
                    "--epochs", "1", "--progress", "plain", "--device", "cpu", "--nproc", "2",
                    "--strategy", "ddp", "--profile", "4", "--out", str(out)], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    profile = json.loads((out / "summary.json").read_text())["profile"]
    shares = profile["shares"]
    assert set(shares) == {"data", "forward", "backward", "optimizer", "communication",
                           "other"}
    assert sum(shares.values()) == pytest.approx(1.0, abs=1e-6), shares
    assert all(0.0 <= share <= 1.0 for share in shares.values()), shares
    assert shares["communication"] > 0 and shares["forward"] > 0 and shares["backward"] > 0
    assert profile["steps"] == 4 and profile["requested_steps"] == 4
    line = next(x for x in done.stderr.splitlines() if "share of step time" in x)
    assert "forward includes the loss" in line and f"other {shares['other']:.0%}" in line
