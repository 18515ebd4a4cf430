"""While `torchgpu bench` starts worker processes, SIGTERM/SIGINT wait until every started
worker is recorded (else a worker the group does not know outlives the bench and fails
to unpickle its queues once the bench is gone). The signal must be held even when other
threads exist (a queue's feeder thread does not block it, and Python would run the
handler in the main thread at once), and delivered, once each, on leaving."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import test_env
from torchgpu.bench.workers import _signals_held


class Stop(Exception):
    pass


@pytest.fixture
def raising_handlers() -> Iterator[list[int]]:
    got: list[int] = []

    def handler(signum: int, frame: object) -> None:
        got.append(signum)
        raise Stop(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield got
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def test_a_signal_is_held_while_other_threads_run_and_raised_on_leaving(
        raising_handlers: list[int]) -> None:
    done = threading.Event()
    other = threading.Thread(target=done.wait, daemon=True)  # a thread that blocks nothing
    other.start()
    steps = 0
    finished = False
    try:
        with pytest.raises(Stop), _signals_held():
            # to the other thread, as the kernel does when this one blocks it
            assert other.ident is not None
            signal.pthread_kill(other.ident, signal.SIGTERM)
            signal.pthread_kill(other.ident, signal.SIGTERM)  # a repeat is raised once
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:  # plenty of bytecode boundaries
                steps += 1
            assert raising_handlers == []  # not yet: the block finishes first
            finished = True
    finally:
        done.set()
        other.join()
    assert finished and steps > 0 and raising_handlers == [signal.SIGTERM]
    # the handlers in place before are back
    assert signal.getsignal(signal.SIGTERM) is not None
    with pytest.raises(Stop):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)


def test_nothing_arrives_nothing_is_raised(raising_handlers: list[int]) -> None:
    with _signals_held():
        pass
    assert raising_handlers == []


# A bench process whose SIGTERM arrives while its workers start, and whose workers are
# slow to read their arguments (the spec unpickles slowly, before the queues do) and
# outlive it (a terminate that misses them, as happens under load).
SLOW_START = """
import multiprocessing, os, signal, time
from torchgpu.bench import workers

class Slow:
    # Unpickled in the worker before its queues: it reads its arguments slowly and, as
    # a worker the parent's exit-time terminate misses, outlives the parent.
    def __reduce__(self):
        return (exec, ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                       "time.sleep(1.5)",))

class SignalAfterStart(multiprocessing.get_context("forkserver").Process):
    def start(self):
        super().start()
        os.kill(os.getpid(), signal.SIGTERM)  # held by the group while workers start

def stop(signum, frame):
    raise KeyboardInterrupt

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop)
    group = workers.WorkerGroup("slow_factory:build", ["cpu", "cpu"], {"slow": Slow()},
                                timeout_s=60)
    group._ctx.Process = SignalAfterStart
    try:
        with group:
            pass
    except KeyboardInterrupt:
        print("stopped", flush=True)
"""


def test_a_stop_while_workers_start_waits_until_they_read_their_queues(
        tmp_path: Path) -> None:
    """The bench exits on the signal and unlinks its queues' semaphores: a worker that had
    not read its arguments yet then failed to open them (FileNotFoundError, a fork
    server's traceback), and the group's workers were left to end by themselves."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs the forkserver start method")
    script = tmp_path / "slow_start.py"
    script.write_text(SLOW_START)
    (tmp_path / "slow_factory.py").write_text(
        "import time\n\n\ndef build(rank, world_size, device, spec):\n    time.sleep(60)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=test_env(), cwd=tmp_path, check=False)
    assert done.stdout.strip() == "stopped", done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr[-3000:]


KILLED_PARENT = """
import sys, time
from torchgpu.bench import workers

if __name__ == "__main__":
    group = workers.WorkerGroup("slow_factory:build", ["cpu", "cpu"], {}, timeout_s=60)
    group.launch()
    print(" ".join(str(p.pid) for p in group._procs), flush=True)
    time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_workers_still_building_their_work_exit_when_the_bench_is_killed(
        tmp_path: Path) -> None:
    """A bench killed with SIGKILL (no code runs) while its workers build their work
    (here: a build that takes a minute): they used to notice only once waiting for a
    command, and ran on for as long as the build took."""
    script = tmp_path / "killed_parent.py"
    script.write_text(KILLED_PARENT)
    (tmp_path / "slow_factory.py").write_text(
        "import time\n\n\ndef build(rank, world_size, device, spec):\n    time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              text=True, env=test_env(), cwd=tmp_path)
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        time.sleep(2)  # the workers form their group and start building
        parent.kill()
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in pids if _running(p)]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"workers still running 10 s after the bench was killed: {left}"
