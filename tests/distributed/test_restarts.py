"""`torchgpu train --nproc 2` with faults: a SIGTERM to one rank stops both at the same
step with a checkpoint; a worker that crashes once is restarted by torchrun
(--max-restarts 1) and the run resumes from its last checkpoint, ending identical to an
uninterrupted run; a killed rank without restarts fails the run fast, naming the rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import HEAVY, START_S, run_cli, test_env

# One xdist worker runs the module: its runs never share the machine with each other, and
# the module's `reference` is trained once.
pytestmark = [pytest.mark.slow, HEAVY]

# 100 samples -> 80 train rows -> 40 per rank -> 5 micro-batches of 8 per epoch.
COMMON = ["--example", "housing", "--data-size", "100", "--batch-size", "8", "--epochs", "30",
          "--progress", "plain", "--device", "cpu", "--nproc", "2"]
TIMING = ("seconds", "samples_per_s")


def _metrics(out: Path) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in TIMING} for x in lines]


def _same_run(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    assert _metrics(a) == _metrics(b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    done = run_cli(["train", *COMMON, "--out", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(x) for x in text]
    return found


def _worker_of_rank(launcher: int, rank: int, timeout_s: float = START_S) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in _children(launcher):
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return child
        time.sleep(0.05)
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher}")


# Four starts of three processes (the reference, the stopped run, the resumed run and its
# restart): 900 s leaves each START_S on a loaded machine.
@pytest.mark.timeout(900)
def test_sigterm_to_one_rank_then_a_crash_and_restart_end_identical(
    tmp_path: Path, reference: Path
) -> None:
    """SIGTERM to rank 1 only: both ranks stop at one step boundary, save, exit 0. The
    resumed run's rank 0 then crashes (SIGKILL) once; torchrun restarts the group, which
    resumes from the newest checkpoint by itself and ends identical to the reference."""
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torchgpu", "train", *COMMON, "--out", str(out),
         "--save-every", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=test_env())
    try:
        worker = _worker_of_rank(launcher.pid, 1)
        latest = out / "checkpoints" / "latest"
        deadline = time.monotonic() + START_S
        while not latest.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert latest.exists(), "no checkpoint to stop after"  # else the stop lands anywhere
        os.kill(worker, signal.SIGTERM)  # rank 1 only; rank 0 learns it at a step boundary
        _, err = launcher.communicate(timeout=START_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, err[-3000:]  # a saved stop exits 0: no restart wanted
    summary = json.loads((out / "summary.json").read_text())
    stopped_at = summary["steps"]
    assert summary["stopped_early"] and 5 <= stopped_at < 120
    assert latest.read_text().strip() == f"step-{stopped_at:08d}"
    assert "--resume" in err

    crash_at = stopped_at + 10  # checkpoints every 4 steps after the resume
    marker = tmp_path / "crashed"
    done = run_cli(["train", *COMMON, "--out", str(out), "--resume", "--save-every", "4",
                    "--max-restarts", "1"], timeout=2 * START_S,
                   TORCHGPU_FAULT_CRASH_AT_STEP=str(crash_at), TORCHGPU_FAULT_MARKER=str(marker),
                   TORCHGPU_FAULT_RANK="0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists()  # the crash happened, once
    assert f"resuming from {out / 'checkpoints'}" in done.stderr
    assert "torchrun restart 1: resuming from" in done.stderr
    _same_run(out, reference)


def test_killed_rank_without_restarts_fails_fast_naming_it(tmp_path: Path) -> None:
    """Rank 1 dies (SIGKILL after step 4). Rank 0 fails in its next collective on the
    closed connection and exits with its own error, instead of waiting there for the
    collective timeout (300 s) until torchrun's teardown SIGKILLs it after its 30 s
    grace; the launcher names both ranks. Speed is measured inside the run, from the
    crash (the marker rank 1 writes as it kills itself) to the launcher's exit, not from
    the test's start: starting three processes on a loaded machine takes what it takes."""
    marker = tmp_path / "m"
    done = run_cli(["train", *COMMON, "--out", str(tmp_path / "run")],
                   TORCHGPU_FAULT_CRASH_AT_STEP="4", TORCHGPU_FAULT_MARKER=str(marker),
                   TORCHGPU_FAULT_RANK="1")
    ended = time.time()
    err = done.stderr
    assert done.returncode == 1, err[-3000:]
    assert "worker rank 1 of torchgpu failed (signal 9)" in err, err[-3000:]
    # The cause: rank 0's own error names the lost peer and the closed connection ...
    assert re.search(r"rank 0 lost a peer in .*(Connection (reset|closed)|by peer|Broken pipe)",
                     err), err[-3000:]
    # ... and it ended by that error (exit code 1), not by torchrun's SIGKILL after the grace.
    assert "worker rank 0 of torchgpu failed (exit code 1)" in err, err[-3000:]
    took_s = ended - marker.stat().st_mtime
    assert took_s < 120, f"the run ended {took_s:.1f} s after rank 1 died"
