"""A stream under `torchgpu launch --nproc 2` (two gloo processes on 127.0.0.1): each
item on one rank, and the weights of one process at the same global batch -- with
--steps-per-epoch, with accumulation, and for a stream with len() whose last batch
leaves rank 1 no rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import REPO, run_cli, run_script_here, test_env

SCRIPT = REPO / "tests" / "distributed" / "fit_stream_script.py"


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ["samples=60", "steps_per_epoch=3"],
    ["samples=70", "steps_per_epoch=2", "accumulate=2"],
    ["samples=60", "steps_per_epoch=3", "num_workers=2"],  # batch b: worker b mod 2
    ["samples=41", "sized=1"],  # 5 batches of 8 and one item: rank 1's last share is empty
])
def test_two_processes_on_a_stream_equal_one(tmp_path: Path, args: list[str]) -> None:
    one_args = [str(tmp_path / "one"), "8", *args]
    if any(arg.startswith("num_workers=") for arg in args):  # forks: in a process of its own
        one = subprocess.run([sys.executable, str(SCRIPT), *one_args], capture_output=True,
                             text=True, timeout=120, env=test_env(), check=False)
        assert one.returncode == 0, one.stderr[-3000:]
        printed = one.stdout
    else:  # the reference in this process: no start-up of its own
        printed = run_script_here(SCRIPT, one_args)
    assert "strategy single world 1" in printed, printed
    two = run_cli(["launch", "--nproc", "2", str(SCRIPT), str(tmp_path / "two"), "4", *args],
                  timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("strategy ddp world 2") == 2
    summaries = [json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two")]
    assert summaries[0]["steps"] == summaries[1]["steps"]
    assert summaries[1]["global_batch"] == summaries[0]["global_batch"]
    a = load_file(tmp_path / "one" / "model.safetensors")
    b = load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


CLI = ["train", "--model", "tests.user_models:stream_model", "--data",
       "tests.user_models:stateful_stream_data", "--loss", "mse", "--epochs", "2",
       "--steps-per-epoch", "4", "--batch-size", "4", "--nproc", "2", "--device", "cpu",
       "--progress", "plain", "--save-every", "3"]


@pytest.mark.slow
def test_a_crashed_ddp_run_on_a_stream_resumes_from_its_state_bitwise(tmp_path: Path) -> None:
    """Rank 1 is killed after step 5 (the last save: step 3, mid-epoch 1); `--resume`
    loads every rank's stream state from the checkpoint and ends bitwise equal to the
    uninterrupted run."""
    whole = run_cli([*CLI, "--out", str(tmp_path / "whole")], timeout=180)
    assert whole.returncode == 0, whole.stderr[-3000:]
    out = tmp_path / "run"
    crashed = run_cli([*CLI, "--out", str(out)], timeout=180,
                      TORCHGPU_FAULT_CRASH_AT_STEP="5", TORCHGPU_FAULT_RANK="1",
                      TORCHGPU_FAULT_MARKER=str(tmp_path / "crashed"))
    assert crashed.returncode != 0 and (tmp_path / "crashed").exists()
    state = torch.load(out / "checkpoints" / "step-00000003" / "state.pt", weights_only=True)
    positions = state["extra"]["data_position_per_rank"]
    assert [p["batch"] for p in positions] == [3, 3]
    resumed = run_cli([*CLI, "--resume", "--out", str(out)], timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stream_resume"] == "state_dict" and summary["steps"] == 8
    a = load_file(tmp_path / "whole" / "model.safetensors")
    b = load_file(out / "model.safetensors")
    for key in a:
        assert torch.equal(a[key], b[key]), key
