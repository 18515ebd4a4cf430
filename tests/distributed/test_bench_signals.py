"""`torchgpu bench` ends its worker processes (and so its fork server) however it ends:
SIGTERM to the bench process alone closes them on the way out; a bench killed with
SIGKILL, which runs no code, leaves workers that notice and exit by themselves."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.distributed.proctree import Session, running
from tests.procs import START_S

pytestmark = pytest.mark.slow


def _workers_started(run: Session, timeout_s: float = START_S) -> list[int]:
    """Wait until the DDP suite's worker processes (children of the fork server, so
    grandchildren of the bench) exist; return every process below the bench."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.proc.poll() is None:
        below = run.look()
        grandchildren = [p for p in below if _parent(p) != run.pid]
        if len(grandchildren) >= 2:
            return below
        time.sleep(0.05)
    raise AssertionError(f"no benchmark workers appeared: {run.stderr()[-2000:]}")


def _parent(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(text.rsplit(")", 1)[1].split()[1])


def _start(tmp_path: Path) -> Session:
    # The full dp-ddp suite runs for minutes: the signal always lands while it runs.
    return Session(["bench", "dp-ddp", "--out", str(tmp_path / "bench")], tmp_path)


def test_sigterm_to_bench_ends_its_workers_and_fork_server(tmp_path: Path) -> None:
    with _start(tmp_path) as run:
        below = _workers_started(run)
        run.proc.send_signal(signal.SIGTERM)  # the bench process alone
        # a few seconds on a quiet machine; the suite it stops would run for minutes, and
        # "bench stopped by SIGTERM" says it was the signal that ended it
        code = run.wait(90)
        deadline = time.monotonic() + 10
        while any(running(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.05)
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 128 + signal.SIGTERM, run.stderr()[-3000:]
    assert "bench stopped by SIGTERM" in run.stderr()
    assert "Traceback" not in run.stderr()


def test_workers_of_a_killed_bench_exit_by_themselves(tmp_path: Path) -> None:
    with _start(tmp_path) as run:
        below = _workers_started(run)
        run.proc.send_signal(signal.SIGKILL)
        run.wait(10)
        # they notice within seconds; unnoticed, they would wait for work forever
        deadline = time.monotonic() + 60
        while any(running(p) for p in below) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in below if running(p)]
    assert not left, f"still running 60 s after the bench was killed: {left}"
    assert not run.leftovers
