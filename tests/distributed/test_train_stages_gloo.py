"""`torchgpu train --strategy pipeline --nproc 2` on CPU: one stage per gloo process on
torch.distributed.pipelining. The step losses, final weights and test metrics match the
one-process run (every rank walks the one-process batch order) on batches that --chunks
does not divide, a smaller last batch with no even split for 1F1B (once skipped) and an
odd test split (once evaluated on a stale row); the file saved by rank 0 holds the whole
model under the plain model's keys, and only rank 0 reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import HEAVY, run_cli
from torchgpu.models import HousingNet

# 123 rows: 98 training rows in batches of 13 (last one 7, prime), 25 test rows (odd);
# --accumulate 2 checks that torch's per-step gradient division stays off.
COMMON = ["--example", "housing", "--data-size", "123", "--epochs", "2", "--batch-size", "13",
          "--accumulate", "2", "--progress", "plain"]


def _steps(out: Path) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["kind"] == "step"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.runner import train

    out = tmp_path_factory.mktemp("single") / "run"
    train(config_from_argv([*COMMON, "--device", "cpu", "--strategy", "single",
                            "--out", str(out)]))
    return out


@pytest.mark.slow
def test_two_stage_processes_match_one_process(tmp_path: Path, single: Path) -> None:
    # 1F1B, 4 micro-batches: 13 rows run as 1 x 4 (GPipe) then 3 x 3 (1F1B), the last 7
    # rows as 3 x 2 (1F1B) then 1 x 1 (GPipe); the 25 test rows forward in one piece.
    out = tmp_path / "stages"
    done = run_cli(["train", *COMMON, "--strategy", "pipeline", "--nproc", "2",
                    "--schedule", "1f1b", "--chunks", "4", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("trained housing (pipeline, 2 process(es)") == 1  # rank 0 only
    assert done.stderr.count("pipeline over 2 processes (1f1b") == 1
    assert len(_steps(out)) == len(_steps(single)) == 8  # no batch skipped
    assert _steps(out) == pytest.approx(_steps(single), rel=1e-5)
    a, b = load_file(out / "model.safetensors"), load_file(single / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    HousingNet(13, out_dim=1).load_state_dict(a, strict=True)
    summary = json.loads((out / "summary.json").read_text())
    one = json.loads((single / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 26
    assert summary["pipeline"]["stages"] == 2 and summary["pipeline"]["chunks"] == 4
    assert summary["steps"] == one["steps"] == 8 and summary["skipped_steps"] == 0
    for key in ("train_loss", "test_loss", "test_r2"):
        assert summary["final"][key] == pytest.approx(one["final"][key], rel=1e-5), key


def test_default_chunks_prefer_an_equal_split() -> None:
    from torchgpu.train.strategies.stages.trainer import default_stage_chunks

    assert default_stage_chunks(20, "gpipe", 2, 2) == 5  # 8 wanted; 5 x 4 rows is one schedule
    assert default_stage_chunks(16, "gpipe", 2, 2) == 8
    assert default_stage_chunks(13, "gpipe", 2, 2) == 8  # prime: 8 uneven micro-batches
    assert default_stage_chunks(1, "1f1b", 2, 2) == 2  # at least one per stage
    assert default_stage_chunks(6, "interleaved1f1b", 2, 4) == 6  # a multiple of the ranks
    assert default_stage_chunks(7, "interleaved1f1b", 2, 4) == 8


def test_chunks_without_a_pipeline_names_the_fix() -> None:
    from torchgpu.errors import UsageError
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.config_checks import validate

    with pytest.raises(UsageError, match=r"--chunks 4 only applies to --strategy pipeline "
                       r"\(got --strategy model\).*Use --strategy pipeline .* or drop --chunks"):
        validate(TrainConfig(example="housing", strategy="model", devices="cpu,cpu", chunks=4))


NAN_RUN = ["--model", "tests.user_models:seq_factory", "--data", "tests.user_models:nan_row_data",
           "--loss", "mse", "--strategy", "pipeline", "--nproc", "2", "--epochs", "2",
           "--batch-size", "8", "--progress", "plain"]


@pytest.mark.slow
@HEAVY
@pytest.mark.timeout(600)  # two runs
def test_stage_pipeline_runs_the_engine_loop_on_a_nonfinite_loss(tmp_path: Path) -> None:
    """The stage pipeline trains in run_epoch: --on-nonfinite skip drops the NaN batch's
    step on every rank (one per epoch), stop raises the loop's error on every rank."""
    out = tmp_path / "skip"
    done = run_cli(["train", *NAN_RUN, "--on-nonfinite", "skip", "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped_steps"] == 2 and summary["steps"] == 8  # 5 batches, 2 epochs
    assert all(x == x for x in _steps(out))  # no NaN reached a step's loss
    stopped = run_cli(["train", *NAN_RUN, "--out", str(tmp_path / "stop")])
    assert stopped.returncode == 1
    assert "loss nan on rank 1" in stopped.stderr and "--on-nonfinite skip" in stopped.stderr
