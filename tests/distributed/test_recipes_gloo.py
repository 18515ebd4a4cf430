"""Recipes under two gloo processes on 127.0.0.1: a fit script that says its global batch
(`effective_batch_size`) keeps it under `torchgpu launch --nproc 2`, and says so in its
first log line; `--autoresume` under --nproc 2 continues a crashed job with the same
command (and through a torchrun restart), bitwise equal to the uninterrupted run, with
no step twice in metrics.jsonl, and then has nothing to do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import REPO, run_cli, run_script_here

SCRIPT = REPO / "tests" / "distributed" / "fit_lm_script.py"


@pytest.mark.slow
def test_effective_batch_size_is_global_under_launch(tmp_path: Path) -> None:
    # the one-process reference in this process: no start-up of its own
    one = run_script_here(SCRIPT, [str(tmp_path / "one"), "4", "effective_batch_size=16",
                                   "samples=64"])
    assert "strategy single world 1" in one, one
    two = run_cli(["launch", "--nproc", "2", str(SCRIPT), str(tmp_path / "two"), "4",
                   "effective_batch_size=16", "samples=64"], timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    first = two.stderr.splitlines()[0]
    assert first == ("batch: 4 samples per process and micro-batch x 2 accumulation x 2 "
                     "process(es) = 16 samples per optimizer step (global batch)")
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    s2 = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert (s1["accumulate"], s1["global_batch"]) == (4, 16)
    assert (s2["accumulate"], s2["global_batch"], s2["world_size"]) == (2, 16, 2)
    assert s1["steps"] == s2["steps"] == 8
    a = load_file(tmp_path / "one" / "model.safetensors")
    b = load_file(tmp_path / "two" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


RUN = ["train", "--example", "housing", "--data-size", "200", "--batch-size", "8",
       "--epochs", "2", "--progress", "off", "--device", "cpu", "--nproc", "2",
       "--save-every", "4", "--log-every", "2"]


def _lines(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in ("seconds", "samples_per_s")}
            for x in lines]


@pytest.mark.slow
def test_autoresume_under_two_processes(tmp_path: Path) -> None:
    ref = tmp_path / "ref"
    done = run_cli([*RUN, "--out", str(ref)], timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    # A job killed after step 9 (rank 0 dies): the same command, requeued, continues.
    out = tmp_path / "job"
    crash = {"TORCHGPU_FAULT_CRASH_AT_STEP": "9", "TORCHGPU_FAULT_MARKER":
             str(tmp_path / "crashed")}
    job = [*RUN, "--out", str(out), "--autoresume"]
    first = run_cli(job, timeout=180, **crash)
    assert first.returncode != 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step-00000008").is_dir()
    again = run_cli(job, timeout=180, **crash)  # the marker exists: no second crash
    assert again.returncode == 0, again.stderr[-3000:]
    assert "--autoresume: continuing the run" in again.stderr
    assert load_file(out / "model.safetensors").keys() == load_file(
        ref / "model.safetensors").keys()
    for key, value in load_file(ref / "model.safetensors").items():
        assert torch.equal(load_file(out / "model.safetensors")[key], value), key
    assert _lines(out) == _lines(ref)  # every step once, the values of the whole run
    # Requeued once more: finished, nothing to do, exit 0.
    last = run_cli(job, timeout=120)
    assert last.returncode == 0 and "nothing to do" in last.stderr, last.stderr[-3000:]
    # A torchrun restart inside one job: the restarted workers continue it too.
    restarted = tmp_path / "restarted"
    crash["TORCHGPU_FAULT_MARKER"] = str(tmp_path / "crashed-2")
    once = run_cli([*RUN, "--out", str(restarted), "--autoresume", "--max-restarts", "1"],
                   timeout=240, **crash)
    assert once.returncode == 0, once.stderr[-3000:]
    for key, value in load_file(ref / "model.safetensors").items():
        assert torch.equal(load_file(restarted / "model.safetensors")[key], value), key
