"""SIGINT/SIGTERM while a verb is still importing torch: one line and 128 + the signal's
number, never a KeyboardInterrupt traceback from inside an import (or a silent death by
SIGTERM). The signal is sent once the process has loaded libtorch, i.e. in the middle of
`import torch` (which takes a second or more)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.distributed.proctree import Session

VERBS = {
    "train": ["train", "--example", "housing", "--epochs", "1", "--device", "cpu"],
    "plan": ["plan", "--example", "housing"],
    "doctor": ["doctor"],
    "bench": ["bench", "matmul", "--quick"],
}


def _importing_torch(pid: int) -> bool:
    try:
        return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("verb", list(VERBS))
def test_a_stop_signal_during_the_imports_ends_with_one_line(
        tmp_path: Path, verb: str, sig: signal.Signals) -> None:
    args = list(VERBS[verb])
    if verb in ("train", "bench"):
        args += ["--out", str(tmp_path / "out")]
    with Session(args, tmp_path) as run:
        deadline = time.monotonic() + 60
        while not _importing_torch(run.pid):
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr()
            time.sleep(0.002)
        run.proc.send_signal(sig)
        code = run.wait(60)
    err = run.stderr()
    assert not run.leftovers
    assert code == 128 + sig, (code, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1].startswith(f"torchgpu: stopped by {sig.name}"), err[-3000:]
