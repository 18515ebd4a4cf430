"""How a launcher (:func:`torchgpu.launcher.run`) stops its workers, and what a stop is.

- :class:`StopForwarder`: SIGTERM/SIGINT sent to the launcher (to it alone, or to its
  process group: torchrun starts each worker in a session of its own, so a group signal
  reaches the launcher only) are passed on to the workers, and whatever still runs
  ``timeout_s`` later is killed with its process group.
- :func:`stop_aware_agent`: torchrun's agent, while it runs here, (1) starts the workers
  with SIGTERM/SIGINT blocked when they are torchgpu's own entry point, which installs
  its handlers first thing and unblocks them (:mod:`torchgpu.cli.signals`): a signal
  sent before that is held instead of killing the worker; and (2) never restarts a
  group after a deliberate stop (``--max-restarts`` is for failures): one of the
  workers recorded a stop signal, the launcher got one, or a worker ended by SIGTERM
  or SIGINT (or exited 130/143, their exit codes).
- :func:`child_pids`: the processes to signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import Any

from torchgpu.stop_signals import STOP_SIGNALS as STOP_SIGNALS
from torchgpu.stop_signals import routed_to
from torchgpu.train.state import record_stop

#: Worker exit codes that mean a stop signal ended it: killed by one (negative, as
#: torchrun reports them), or exited with the shell's 128 + its number.
STOP_EXIT_CODES = frozenset({-int(signal.SIGTERM), -int(signal.SIGINT),
                             128 + int(signal.SIGTERM), 128 + int(signal.SIGINT)})


def agent_signals(names: str) -> str:
    """torchrun's ``--signals-to-handle`` list without SIGTERM and SIGINT (they are
    forwarded by :class:`StopForwarder`); never empty (torchrun warns on an empty name)."""
    kept = [n.strip() for n in names.split(",")
            if n.strip() and n.strip() not in {s.name for s in STOP_SIGNALS}]
    return ",".join(kept) or "SIGHUP"


def child_pids(pid: int | None = None) -> list[int]:
    """The direct children of ``pid`` (default: this process): from
    ``/proc/PID/task/*/children`` on Linux, else from every process's parent in
    ``/proc/*/stat``, else from ``ps``. Empty when none can be read."""
    pid = os.getpid() if pid is None else pid
    found: set[int] = set()
    tasks = Path(f"/proc/{pid}/task")
    listed = False
    try:
        for task in tasks.iterdir():
            children = task / "children"
            if children.exists():
                listed = True
                found.update(int(x) for x in children.read_text().split())
    except OSError:
        pass
    if listed:
        return sorted(found)
    if Path("/proc/self/stat").exists():
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                # "pid (comm) state ppid ...": comm may hold spaces and parentheses
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
        return sorted(found)
    try:
        listing = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True,
                                 text=True, timeout=5, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1] == str(pid):
            found.add(int(parts[0]))
    return sorted(found)


def _kill_group(pid: int, sig: signal.Signals) -> None:
    """``sig`` to ``pid``'s process group when ``pid`` leads one (torchrun starts each
    worker in a session of its own, with whatever it started), else to ``pid``."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class StopForwarder:
    """Passes SIGTERM/SIGINT received by a launcher on to its workers, within a bound.

    While :meth:`installed`: the first SIGTERM or SIGINT is sent to every child process
    (each worker itself, not its group: a worker ends its own DataLoader workers), and a
    watcher thread sends it to children that appear later (a group torchrun restarts)
    until :meth:`installed` exits. A second SIGINT is sent again (a worker then raises
    KeyboardInterrupt); a repeated SIGTERM is not (a worker finishing its save must not
    be killed by a scheduler's repeated signal). ``timeout_s`` after the first signal,
    every child still running is SIGKILLed with its process group (``killed`` lists
    them). ``received`` is the first signal, or None.

    ``children`` lists the processes to signal (default :func:`child_pids`: this
    process's children, which under torchrun are the workers).
    """

    def __init__(self, timeout_s: float,
                 children: Callable[[], list[int]] = child_pids) -> None:
        self.timeout_s = timeout_s
        self.received: signal.Signals | None = None
        self.killed: list[int] = []
        self._children = children
        self._sent: set[int] = set()
        self._lock = threading.RLock()  # the handler may interrupt the main thread anywhere
        self._done = threading.Event()
        self._watcher: threading.Thread | None = None

    @contextmanager
    def installed(self) -> Iterator[StopForwarder]:
        """Handle SIGTERM/SIGINT while the block runs (main thread only; elsewhere the
        block runs with the handlers as they are)."""
        try:
            with routed_to(self._handle):
                yield self
        finally:
            self._done.set()
            if self._watcher is not None:
                self._watcher.join(timeout=5)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
            record_stop(sig.name, None)  # restarted or still-starting workers honour it
            print(f"torchgpu: {sig.name} received: passed on to the workers, which stop at "
                  f"their next step boundary (killed if still running after "
                  f"{self.timeout_s:g} s).", file=sys.stderr, flush=True)
            self.forward(sig)
            self._watcher = threading.Thread(target=self._watch, name="torchgpu-stop",
                                             daemon=True)
            self._watcher.start()
        elif sig == signal.SIGINT:
            self.forward(sig, again=True)

    def forward(self, sig: signal.Signals, again: bool = False) -> None:
        """Send ``sig`` to every child not sent one yet (``again``: to every child)."""
        with self._lock:
            for pid in self._children():
                if pid in self._sent and not again:
                    continue
                self._sent.add(pid)
                with suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)

    def _watch(self) -> None:
        assert self.received is not None
        deadline = time.monotonic() + self.timeout_s
        while not self._done.wait(0.1):
            if time.monotonic() < deadline:
                self.forward(self.received)  # workers started since the signal
                continue
            with self._lock:
                self.killed = self._children()
                for pid in self.killed:
                    _kill_group(pid, signal.SIGKILL)
            if self.killed:
                print(f"torchgpu: workers still running {self.timeout_s:g} s after "
                      f"{self.received.name} were killed (pids "
                      f"{', '.join(map(str, self.killed))}).", file=sys.stderr, flush=True)
            return


def stopped_by_signal(failures: dict[int, Any]) -> signal.Signals | None:
    """The stop signal that ended one of torchrun's failed workers (``failures``: rank ->
    ProcessFailure), or None when none ended that way."""
    for failure in failures.values():
        code = int(getattr(failure, "exitcode", 0) or 0)
        if code in STOP_EXIT_CODES:
            return signal.Signals(-code if code < 0 else code - 128)
    return None


@contextmanager
def stop_aware_agent(hold_signals: bool, stopped: Callable[[Any], bool]) -> Iterator[None]:
    """While the block runs, torchrun's agent (made by torch's ``launch_agent``) is a
    subclass of its own that starts the workers with SIGTERM/SIGINT blocked when
    ``hold_signals`` (their mask is inherited; only workers that unblock them, i.e.
    torchgpu's entry point, may be started so), and that gives up its remaining
    restarts when a round failed and ``stopped(result)`` says a stop caused it. A torch
    without these hooks runs unchanged (the workers then honour the stop record)."""
    try:
        from torch.distributed.launcher import api
    except ImportError:
        yield
        return
    base = getattr(api, "LocalElasticAgent", None)
    if base is None or not all(hasattr(base, name) for name in
                               ("_start_workers", "_monitor_workers")):
        yield
        return

    class Agent(base):  # type: ignore[misc,valid-type]
        def _start_workers(self, worker_group: Any) -> Any:
            if not hold_signals or not hasattr(signal, "pthread_sigmask"):
                return super()._start_workers(worker_group)
            previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
            try:
                return super()._start_workers(worker_group)
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, previous)

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            state = getattr(getattr(result, "state", None), "name", "")
            if state in ("FAILED", "UNHEALTHY") and stopped(result):
                self._remaining_restarts = 0  # a deliberate stop is not retried
            return result

    setattr(api, "LocalElasticAgent", Agent)  # noqa: B010  (not exported to the type checker)
    try:
        yield
    finally:
        setattr(api, "LocalElasticAgent", base)  # noqa: B010
