"""Real SIGTERM/SIGINT to `torchgpu train --nproc 2` while it starts and while it ends.

A deliberate stop is a stop whenever it lands: while a rank still imports, while rank 0
waits for a peer that is not coming, or after the run finished. Both gloo ranks end within
seconds, the launcher exits 0 with one line saying what happened, nothing is restarted
(--max-restarts is for failures, not for a stop) or retrained, and no process is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from pathlib import Path

import pytest

from tests.distributed.proctree import Session, environ
from tests.procs import START_S

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a start (START_S at most), its end

# 100 samples, batch 8: 5 steps per epoch per rank; many epochs, so a run that is not
# stopped would go on far longer than the bounds below.
COMMON = ["--example", "housing", "--data-size", "100", "--batch-size", "8",
          "--progress", "off", "--device", "cpu", "--nproc", "2", "--strategy", "ddp"]
# signal -> launcher gone: a rank's import of torch, then the stop (~5 s on a quiet
# machine; a start takes up to START_S on a loaded one). A stop turned into a failure
# (torchrun's SIGKILL after its 30 s grace, a restart) is told by its words, not its time.
STOP_BOUND_S = 120.0


def _check_clean_stop(run: Session, code: int, out: Path, sent: float, who: str) -> str:
    took = time.monotonic() - sent
    err = run.stderr()
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 0, err[-3000:]
    assert took < STOP_BOUND_S, f"{took:.1f} s"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "failed" not in err and "restart" not in err, err[-3000:]
    assert f"stopped by {who} before training started" in err, err[-3000:]
    assert not (out / "summary.json").exists()  # nothing trained, nothing written
    return err


def _first_sight(run: Session, rank: int) -> int:
    """The worker of ``rank``, as soon as it exists (it is still starting Python)."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and run.proc.poll() is None:
        for pid in run.look():
            if f"RANK={rank}".encode() in environ(pid):
                return pid
        time.sleep(0.005)
    raise AssertionError(f"no rank {rank}: {run.stderr()[-2000:]}")


@pytest.mark.parametrize("rank", [1, 0])
def test_sigterm_to_a_starting_rank_stops_the_run_without_restarting_it(
        tmp_path: Path, rank: int) -> None:
    """The signal lands as the worker starts (before any handler of Python's own could
    run); with --max-restarts 1 torchrun used to restart the group and train to the end."""
    out = tmp_path / "run"
    args = ["train", *COMMON, "--epochs", "100000", "--max-restarts", "1", "--out", str(out)]
    with Session(args, tmp_path) as run:
        pid = _first_sight(run, rank)
        os.kill(pid, signal.SIGTERM)
        sent = time.monotonic()
        code = run.wait(STOP_BOUND_S + 30)
    # rank 0 reports: its own signal by name, a peer's with the peer's rank
    _check_clean_stop(run, code, out, sent, "SIGTERM" if rank == 0 else "SIGTERM on rank 1")


def test_a_rank_stopped_while_its_peer_waits_for_it_ends_in_seconds(tmp_path: Path) -> None:
    """Rank 1 is frozen (SIGSTOP) while it starts, so rank 0 waits for it in the
    rendezvous; then rank 1 gets SIGTERM. Rank 0 used to wait on, until torchrun's
    30 s grace ended in SIGKILL and exit 1."""
    out = tmp_path / "run"
    with Session(["train", *COMMON, "--epochs", "100000", "--out", str(out)], tmp_path) as run:
        rank1 = _first_sight(run, 1)
        os.kill(rank1, signal.SIGSTOP)
        rank0 = run.worker(0)
        beats = Path(next(v.split(b"=", 1)[1].decode() for v in environ(rank0)
                          if v.startswith(b"TORCHGPU_HEARTBEAT_DIR=")))
        run.wait_for(beats / "rank0.json")  # rank 0 is at its rendezvous
        time.sleep(1.0)
        os.kill(rank1, signal.SIGTERM)
        os.kill(rank1, signal.SIGCONT)
        sent = time.monotonic()
        code = run.wait(STOP_BOUND_S + 30)
    # rank 0 did not wait for torchrun's 30 s grace and its SIGKILL: that would be exit 1,
    # "failed (signal 9)"
    _check_clean_stop(run, code, out, sent, "SIGTERM on rank 1")


@pytest.mark.parametrize(("sig", "where"), [(signal.SIGTERM, "launcher"),
                                            (signal.SIGINT, "group")])
def test_a_stop_while_the_workers_start_is_a_stop_not_a_failure(
        tmp_path: Path, sig: signal.Signals, where: str) -> None:
    """To the launcher (forwarded) or to its group (Ctrl-C) as the workers appear: no
    "worker failed (signal 15)", no KeyboardInterrupt traceback from `import torch`."""
    out = tmp_path / "run"
    with Session(["train", *COMMON, "--epochs", "100000", "--out", str(out)], tmp_path) as run:
        _first_sight(run, 1)
        if where == "group":
            os.killpg(run.pid, sig)
        else:
            os.kill(run.pid, sig)
        sent = time.monotonic()
        code = run.wait(STOP_BOUND_S + 30)
    _check_clean_stop(run, code, out, sent, sig.name)


def test_sigterm_to_a_rank_of_a_finished_run_changes_nothing(tmp_path: Path) -> None:
    """The run has finished (rank 1's heartbeat says done) and rank 1 is tearing down when
    SIGTERM reaches it: the launcher exits 0, nothing is restarted or retrained (it used
    to die of the signal, and --max-restarts retrained from the last checkpoint)."""
    out = tmp_path / "run"
    args = ["train", *COMMON, "--epochs", "12", "--save-every", "20", "--max-restarts", "1",
            "--out", str(out)]
    with Session(args, tmp_path) as run:
        rank1 = run.worker(1)
        beats = Path(next(v.split(b"=", 1)[1].decode() for v in environ(rank1)
                          if v.startswith(b"TORCHGPU_HEARTBEAT_DIR=")))
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and run.proc.poll() is None:
            try:
                if json.loads((beats / "rank1.json").read_text()).get("phase") == "done":
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.002)
        mtime = (out / "summary.json").stat().st_mtime_ns
        with contextlib.suppress(ProcessLookupError):  # already gone: nothing to stop
            os.kill(rank1, signal.SIGTERM)
        code = run.wait(60)
    err = run.stderr()
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 0, err[-3000:]
    assert "failed" not in err and "resuming" not in err and "restart" not in err, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert not summary["stopped_early"] and summary["steps"] == 12 * 5
    assert (out / "summary.json").stat().st_mtime_ns == mtime  # not written again


def test_sigterm_while_the_launcher_hands_the_csv_over_leaves_no_file(tmp_path: Path) -> None:
    """The launcher parses the CSV once and writes it to a temporary file for its workers
    (torchgpu-data-*/data.npz in $TMPDIR); a SIGTERM while it does used to kill it with
    the file left behind."""
    table = tmp_path / "table.csv"
    rng = random.Random(0)
    rows = [f"{rng.random():.6f},{rng.random():.6f},{rng.random():.6f},{rng.random():.6f}"
            for _ in range(200_000)]
    table.write_text("a,b,c,y\n" + "\n".join(rows) + "\n")
    temp = tmp_path / "tmp"
    temp.mkdir()
    args = ["train", "--data", str(table), "--target", "y", "--nproc", "2", "--strategy",
            "ddp", "--device", "cpu", "--epochs", "1", "--progress", "off", "--out",
            str(tmp_path / "run")]
    with Session(args, tmp_path, TMPDIR=str(temp)) as run:
        deadline = time.monotonic() + START_S
        while not list(temp.glob("torchgpu-data-*")):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr()
            time.sleep(0.001)
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(60)
    err = run.stderr()
    assert not run.leftovers
    assert "Traceback" not in err, err[-3000:]
    assert code in (0, 128 + signal.SIGTERM), err[-3000:]
    assert "stopped by SIGTERM" in err, err[-3000:]
    assert list(temp.iterdir()) == []  # no hand-off, no torchrun log directory either
