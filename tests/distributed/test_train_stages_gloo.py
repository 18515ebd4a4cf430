"""`torchgpu train --strategy pipeline --nproc 2` on CPU: one stage per gloo process on
torch.distributed.pipelining. The step losses and final weights match the one-process
run (every rank walks the one-process batch order), the file saved by rank 0 holds the
whole model under the plain model's keys, and only rank 0 reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import run_cli
from torchgpu.models import HousingNet

# 96 training rows: batch 20 leaves a last batch of 16, which gets its own schedule.
COMMON = ["--example", "housing", "--data-size", "120", "--epochs", "2", "--batch-size", "20",
          "--progress", "plain"]


def _steps(out: Path) -> list[float]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["kind"] == "step"]


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from torchgpu.cli.train import config_from_argv
    from torchgpu.train.runner import train

    out = tmp_path_factory.mktemp("single") / "run"
    train(config_from_argv([*COMMON, "--device", "cpu", "--strategy", "single",
                            "--out", str(out)]))
    return out


@pytest.mark.slow
def test_two_stage_processes_match_one_process(tmp_path: Path, single: Path) -> None:
    # --chunks 8 caps the micro-batches: 20 rows run as 5 equal ones, the last 16 as 8
    out = tmp_path / "stages"
    done = run_cli(["train", *COMMON, "--strategy", "pipeline", "--nproc", "2",
                    "--chunks", "8", "--out", str(out)], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("trained housing (pipeline, 2 process(es)") == 1  # rank 0 only
    assert done.stderr.count("pipeline over 2 processes") == 1
    assert _steps(out) == pytest.approx(_steps(single), rel=1e-5)
    a, b = load_file(out / "model.safetensors"), load_file(single / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    HousingNet(13, out_dim=1).load_state_dict(a, strict=True)
    summary = json.loads((out / "summary.json").read_text())
    one = json.loads((single / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 20
    assert summary["pipeline"]["stages"] == 2 and summary["pipeline"]["skipped_batches"] == 0
    assert summary["final"]["test_loss"] == pytest.approx(one["final"]["test_loss"], rel=1e-5)
    assert summary["final"]["test_r2"] == pytest.approx(one["final"]["test_r2"], rel=1e-4)
