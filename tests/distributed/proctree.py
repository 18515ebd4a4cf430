"""Process-tree helpers for the signal tests (Linux /proc, no psutil): start a command in
a session of its own, find its workers, send real signals, and make sure that nothing it
started is left running afterwards (leftovers are killed, and the test fails)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tests.procs import START_S, test_env


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of ``pid``, or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1]), int(fields[2])


def _all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an exited child nobody reaped yet)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(root: int) -> list[int]:
    """Every running process below ``root`` (children, their children, ...)."""
    parent = {}
    for pid in _all_pids():
        stat = _stat(pid)
        if stat is not None and stat[0] not in ("Z", "X"):
            parent[pid] = stat[1]
    found: list[int] = []
    frontier = [root]
    while frontier:
        current = frontier.pop()
        kids = [pid for pid, ppid in parent.items() if ppid == current]
        found += kids
        frontier += kids
    return found


def in_groups(pgids: set[int]) -> list[int]:
    """Running processes whose process group is one of ``pgids``."""
    return [pid for pid in _all_pids()
            if (stat := _stat(pid)) is not None and stat[0] not in ("Z", "X")
            and stat[2] in pgids and pid != os.getpid()]


def environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


class Session:
    """``python -m torchgpu ARGS`` in a new session (its own process group, as a shell
    job), output to files (a full pipe would block it). ``seen`` collects every process
    observed below it, so processes started in sessions of their own (torchrun's
    workers) are checked at the end too. Use as a context manager: on exit every process
    seen or still in its groups is killed, and :attr:`leftovers` names those that were
    still running."""

    def __init__(self, args: Sequence[str], tmp: Path, **env: str) -> None:
        self.stdout_path, self.stderr_path = tmp / "stdout.txt", tmp / "stderr.txt"
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torchgpu", *args], stdout=out, stderr=err,
                env=test_env(**env), start_new_session=True)
        self.pid = self.proc.pid
        self.seen: set[int] = set()
        self.leftovers: list[int] = []

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.look()
        groups = {self.pid} | self.seen
        deadline = time.monotonic() + 10
        while True:  # a process may take a moment to exit after its parent did
            alive = sorted({p for p in self.seen | {self.pid} if running(p)}
                           | set(in_groups(groups)))
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.leftovers = alive
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def look(self) -> list[int]:
        """Record (and return) the processes below the command right now."""
        found = descendants(self.pid)
        self.seen.update(found)
        return found

    def worker(self, rank: int, timeout_s: float = START_S) -> int:
        """The pid of the process below the command whose environment has RANK=rank."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            for pid in self.look():
                if f"RANK={rank}".encode() in environ(pid):
                    return pid
            time.sleep(0.05)
        raise AssertionError(f"no worker with RANK={rank} below pid {self.pid}: "
                             f"{self.stderr()[-2000:]}")

    def wait_for(self, path: Path, timeout_s: float = START_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{path} never appeared: {self.stderr()[-2000:]}")
            time.sleep(0.02)
        self.look()

    def wait(self, timeout_s: float) -> int:
        """The exit code, or AssertionError when it has not exited within ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout_s} s later: "
                                 f"{self.stderr()[-2000:]}") from None

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")
