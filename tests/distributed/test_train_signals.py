"""Real SIGTERM/SIGINT to `torchgpu train`, as a cluster's preemption or Ctrl-C sends them.

Two gloo processes on 127.0.0.1 (`--nproc 2 --strategy ddp`) with one-second-long runs of
5-step epochs (shorter than the ranks' agreement period) and many epochs to go: whether
the signal goes to the launcher, to its process group or to rank 0 alone, both ranks stop
at one step within seconds, the stop's checkpoint is written and verifies, the launcher
exits 0 without a traceback, `--resume` continues from the checkpoint, and no process is
left. The same for one process, and for SIGINT.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.proctree import Session
from tests.procs import HEAVY, run_cli
from torchgpu.checkpoint import verify_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a start (START_S at most), its end

# 100 samples -> 80 train rows -> 5 micro-batches of 8 per rank per epoch (10 ms or so):
# many epochs per agreement period, and far more epochs than a test waits for.
COMMON = ["--example", "housing", "--data-size", "100", "--batch-size", "8",
          "--epochs", "100000", "--progress", "off", "--device", "cpu"]
SAVES = ["--save-every", "20", "--keep-last", "2"]
DDP = ["--nproc", "2", "--strategy", "ddp"]
# signal -> the stop's checkpoint on disk (its manifest's time, written by the run): the
# next agreement (~0.5 s) and the save, ~1 s on a quiet machine; far below the launcher's
# 60 s --stop-timeout, after which it kills the workers unsaved
STOP_BOUND_S = 20.0
# signal -> the launcher has exited (a hang guard: the save, then the teardown)
EXIT_BOUND_S = 90.0


def _stop(tmp_path: Path, extra: list[str], sig: signal.Signals, where: str,
          saves: bool = True) -> dict[str, Any]:
    """Start a run (``saves``: with --save-every), wait until it trains, send ``sig`` to
    ``where`` (the launcher, its process group, or rank 0), and check the clean, saved,
    bounded stop. Returns the summary, with the stop checkpoint's path and position."""
    out = tmp_path / "run"
    flags = [*COMMON, *extra, *(SAVES if saves else [])]
    with Session(["train", *flags, "--out", str(out)], tmp_path) as run:
        # Training is under way: a checkpoint, or the metrics of a few epochs.
        run.wait_for(out / "checkpoints" / "latest" if saves else out / "metrics.jsonl")
        if not saves:
            while run.proc.poll() is None and (out / "metrics.jsonl").stat().st_size < 2000:
                time.sleep(0.02)
        target = run.worker(0) if where == "rank 0" else run.pid
        run.look()
        sent = time.time()
        if where == "group":
            os.killpg(run.pid, sig)
        else:
            os.kill(target, sig)
        code = run.wait(EXIT_BOUND_S)
    err = run.stderr()
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    step = summary["stopped_at_step"]
    assert summary["stopped_early"] and sig.name in summary["stop_reason"]
    assert step == summary["steps"] and step >= (20 if saves else 1)
    world = 2 if extra == DDP else 1
    assert summary["stop_steps_by_rank"] == [step] * world  # one boundary on every rank
    checkpoint = out / "checkpoints" / f"step-{step:08d}"
    assert (out / "checkpoints" / "latest").read_text().strip() == checkpoint.name
    if not saves:  # the stop's checkpoint is the only one
        assert [p.name for p in (out / "checkpoints").glob("step-*")] == [checkpoint.name]
    verify_checkpoint(checkpoint)
    meta = json.loads((checkpoint / "meta.json").read_text())
    assert meta["step"] == step
    saved_after_s = (checkpoint / "manifest.json").stat().st_mtime - sent
    assert saved_after_s < STOP_BOUND_S, f"stopped {saved_after_s:.1f} s after {sig.name}"
    assert f"stopped by {sig.name}" in err and f"after step {step}" in err
    summary["checkpoint"] = checkpoint
    summary["position"] = meta["position"]
    return summary


@HEAVY
@pytest.mark.timeout(900)  # two runs
def test_sigterm_to_the_launcher_stops_both_ranks_saved_and_resumable(tmp_path: Path) -> None:
    summary = _stop(tmp_path, DDP, signal.SIGTERM, "launcher")
    assert summary["stop_reason"] == "SIGTERM"
    # --epochs is not part of the saved position: the resumed run ends one epoch later.
    epochs = summary["position"]["epoch"] + 2
    out = tmp_path / "run"
    done = run_cli(["train", *COMMON, *DDP, *SAVES, "--out", str(out), "--resume",
                    "--epochs", str(epochs)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {summary['checkpoint']}" in done.stderr
    resumed = json.loads((out / "summary.json").read_text())
    assert not resumed["stopped_early"] and resumed["epochs"] == epochs
    assert resumed["steps"] > summary["stopped_at_step"]


def test_sigterm_to_the_process_group_stops_both_ranks_saved(tmp_path: Path) -> None:
    _stop(tmp_path, DDP, signal.SIGTERM, "group")


def test_sigterm_to_rank_0_alone_stops_both_ranks_saved(tmp_path: Path) -> None:
    _stop(tmp_path, DDP, signal.SIGTERM, "rank 0")


def test_sigint_to_the_process_group_stops_both_ranks_saved(tmp_path: Path) -> None:
    """Ctrl-C in a terminal: SIGINT to the foreground process group. Without
    --save-every: the stop writes its checkpoint all the same."""
    _stop(tmp_path, DDP, signal.SIGINT, "group", saves=False)


def test_sigint_to_one_process_stops_saved(tmp_path: Path) -> None:
    summary = _stop(tmp_path, ["--strategy", "single"], signal.SIGINT, "group")
    assert summary["world_size"] == 1


def test_sigterm_to_one_process_without_save_every_stops_saved(tmp_path: Path) -> None:
    summary = _stop(tmp_path, ["--strategy", "single"], signal.SIGTERM, "launcher",
                    saves=False)
    assert summary["world_size"] == 1


def test_sigterm_to_rank_1_of_the_stage_pipeline_names_it_and_saves(tmp_path: Path) -> None:
    """`--strategy pipeline --nproc 2`: the stop is saved, and the summary names the rank
    that got the signal, with one stop step per process (it said "a stop on another
    rank", with one entry)."""
    out = tmp_path / "run"
    flags = [*COMMON, "--nproc", "2", "--strategy", "pipeline", "--schedule", "1f1b"]
    with Session(["train", *flags, "--out", str(out)], tmp_path) as run:
        run.wait_for(out / "metrics.jsonl")
        while run.proc.poll() is None and (out / "metrics.jsonl").stat().st_size < 2000:
            time.sleep(0.02)
        os.kill(run.worker(1), signal.SIGTERM)
        code = run.wait(EXIT_BOUND_S)
    err = run.stderr()
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 0 and "Traceback" not in err, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    step = summary["stopped_at_step"]
    assert summary["stop_reason"] == "SIGTERM on rank 1"
    assert summary["stop_steps_by_rank"] == [step, step]
    verify_checkpoint(out / "checkpoints" / f"step-{step:08d}")
    assert f"stopped by SIGTERM on rank 1 after step {step}" in err
