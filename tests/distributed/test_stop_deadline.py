"""A stop that cannot reach a step boundary still ends: a DataLoader worker stuck in
``__getitem__`` (tests/distributed/faulty.py) holds the step forever, and SIGTERM's saved
stop waits for that step's end. Within --stop-timeout of the signal (shortened to 5 s by
a second one) the run ends: one line saying why, exit 143, the checkpoints written
before intact, and no DataLoader worker left behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.distributed.faulty import marks
from tests.distributed.proctree import Session
from tests.procs import REPO
from torchgpu.checkpoint import verify_checkpoint

pytestmark = pytest.mark.slow

FAULTY = f"{REPO}/tests/distributed/faulty.py"


def _stuck_run(tmp_path: Path, stop_timeout: float, signals: int) -> tuple[int, str, float]:
    """One process, one DataLoader worker that hangs for good on its 30th item; once it
    hangs, ``signals`` SIGTERMs 1 s apart. (exit code, stderr, seconds from the first
    signal to the exit)."""
    out = tmp_path / "run"
    args = ["train", "--model", f"{FAULTY}:model", "--data", f"{FAULTY}:data", "--loss", "mse",
            "--device", "cpu", "--batch-size", "4", "--epochs", "50", "--progress", "off",
            "--num-workers", "1", "--save-every", "2", "--stop-timeout", str(stop_timeout),
            "--out", str(out)]
    with Session(args, tmp_path, FAULTY_ITEM="single:30:forever",
                 FAULTY_MARK=str(tmp_path / "marks")) as run:
        deadline = time.monotonic() + 90
        while not marks(tmp_path / "marks"):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr()[-3000:]
            time.sleep(0.05)
        time.sleep(0.5)  # the main process waits for the stuck batch
        assert len(run.look()) >= 1  # its DataLoader worker, checked for at the end
        sent = time.monotonic()
        for i in range(signals):
            if i:
                time.sleep(1.0)
            os.kill(run.pid, signal.SIGTERM)
        code = run.wait(stop_timeout + 30)
        took = time.monotonic() - sent
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert checkpoints, run.stderr()[-3000:]
    for checkpoint in checkpoints:  # none half-written
        verify_checkpoint(checkpoint)
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == checkpoints[-1].name
    return code, run.stderr(), took


def test_a_stop_stuck_in_data_loading_ends_after_the_stop_timeout(tmp_path: Path) -> None:
    code, err, took = _stuck_run(tmp_path, stop_timeout=4, signals=1)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert 4 <= took < 4 + 15, f"ended {took:.1f} s after SIGTERM"
    assert "did not reach a step boundary within 4 s (--stop-timeout" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_second_sigterm_shortens_the_stop_timeout(tmp_path: Path) -> None:
    code, err, took = _stuck_run(tmp_path, stop_timeout=120, signals=2)
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert took < 1 + 5 + 15, f"ended {took:.1f} s after the first SIGTERM"
    assert "did not reach a step boundary within 120 s" in err, err[-3000:]
