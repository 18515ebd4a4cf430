"""How a launcher (:func:`torchgpu.launch.run.run`) stops its workers, and what a stop is.

- :class:`StopForwarder`: SIGTERM/SIGINT sent to the launcher (to it alone, or to its
  process group: torchrun starts each worker in a session of its own, so a group signal
  reaches the launcher only) are passed on to the workers, and whatever still runs
  ``timeout_s`` later is killed with its process group.
- :func:`stop_aware_agent`: torchrun's agent, while it runs here, (1) starts the workers
  with SIGTERM/SIGINT blocked when they are torchgpu's own entry point, which installs
  its handlers first thing and unblocks them (:mod:`torchgpu.cli.signals`): a signal
  sent before that is held instead of killing the worker; and (2) never restarts a
  group after a deliberate stop (``--max-restarts`` is for failures), as
  :class:`StopJudge` tells it.
- :class:`StopJudge`: what a stop is. Only a signal from outside the launcher: one the
  launcher got, one a worker recorded, or a worker ended by SIGTERM/SIGINT (or exited
  130/143, their exit codes) -- each counted only when it came before torchrun's agent
  began tearing the round down. After one worker failed (a crash, a start-up timeout)
  the agent sends SIGTERM to the others itself; what they record or how they end then
  is the teardown's doing, never a stop, so the round is restarted (``--max-restarts``)
  and reported as the failure it is.
- :func:`child_pids`: the processes to signal.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType
from typing import Any

from torchgpu.launch.stop_record import clear_stop, record_stop, recorded_stop
from torchgpu.stop_signals import STOP_SIGNALS as STOP_SIGNALS
from torchgpu.stop_signals import routed_to

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


def signal_in(words: str | None) -> signal.Signals | None:
    """The stop signal a stop record names (``"SIGTERM on rank 1"``), if any."""
    name = (words or "").split(" ", 1)[0]
    return signal.Signals[name] if name in signal.Signals.__members__ else None


def _still_running(pid: int) -> bool:
    """Whether this process's child ``pid`` has not exited yet (an exited one is left
    for its owner to reap: ``WNOWAIT``). Unknown (no ``waitid``): True."""
    if not hasattr(os, "waitid"):
        return True
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False
    except OSError:
        return True


class StopJudge:
    """Whether a round of workers ended by a deliberate stop or by a failure.

    A stop is a signal from outside the launcher: :attr:`forwarder`'s (the launcher
    got it), a worker's stop record (:func:`~torchgpu.launch.stop_record.recorded_stop`), or a
    worker ended by SIGTERM/SIGINT (:func:`stopped_by_signal`). torchrun's agent, once
    a worker failed, ends the others with a SIGTERM of its own (its teardown), which
    they record and die of like any SIGTERM; :meth:`teardown` is called just before
    that (:func:`stop_aware_agent` hooks it) and freezes the evidence: the record as it
    was then, and the workers still running then, whose exits are the teardown's.
    :meth:`new_round` (torchrun restarts the group) removes a record the teardown
    caused, so the restarted workers do not take it for a stop.
    """

    def __init__(self, forwarder: StopForwarder) -> None:
        self.forwarder = forwarder
        self._torn_down = False
        self._record: str | None = None  # the stop record when the teardown began
        self._signalled: frozenset[int] = frozenset()  # pids the teardown signalled

    def teardown(self, pids: Iterable[int]) -> None:
        """torchrun's agent is about to signal ``pids`` (those still running) to end the
        round; only the first call of a round counts."""
        if self._torn_down:
            return
        self._record = recorded_stop()
        self._signalled = frozenset(pid for pid in pids if _still_running(pid))
        self._torn_down = True

    def new_round(self) -> None:
        """torchrun starts a group of workers (the first, or a restart)."""
        if self._torn_down and self._record is None:
            clear_stop()  # what the teardown's SIGTERM made the workers record
            if self.forwarder.received is not None:  # a stop that came meanwhile stays
                record_stop(self.forwarder.received.name, None)
        self._torn_down, self._record, self._signalled = False, None, frozenset()

    def recorded(self) -> str | None:
        """The stop record in words (None: no stop), the teardown's left out."""
        return self._record if self._torn_down else recorded_stop()

    def signal(self, failures: dict[int, Any]) -> signal.Signals | None:
        """The stop signal that ended the round (``failures``: torchrun's rank ->
        ProcessFailure), or None when it failed (or has not ended)."""
        ours = {rank: failure for rank, failure in failures.items()
                if getattr(failure, "pid", None) not in self._signalled}
        return (self.forwarder.received or stopped_by_signal(ours)
                or signal_in(self.recorded()))

    def stopped(self, result: Any) -> bool:
        """Whether torchrun's ``result`` of a round is a stop (never restarted)."""
        if self.forwarder.received is not None:
            return True
        return (self.recorded() is not None
                or self.signal(getattr(result, "failures", None) or {}) is not None)


@contextmanager
def stop_aware_agent(hold_signals: bool, judge: StopJudge, nodes: Any = None) -> Iterator[None]:
    """While the block runs, torchrun's agent (made by torch's ``launch_agent``) is a
    subclass of its own that starts the workers with SIGTERM/SIGINT blocked when
    ``hold_signals`` (their mask is inherited; only workers that unblock them, i.e.
    torchgpu's entry point, may be started so), that tells ``judge`` when a round
    starts and when it tears a round down (before it signals the workers), and that
    gives up its remaining restarts when a round failed and ``judge`` says a stop
    caused it. ``nodes`` (a :class:`~torchgpu.launch.nodes.NodeWatch`, several nodes
    only) is told of each rendezvous (it runs inside ``nodes.rendezvous(handler)``) and
    of the end of each round. A torch without these hooks runs unchanged (the workers
    then honour the stop record)."""
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
            judge.new_round()
            if not hold_signals or not hasattr(signal, "pthread_sigmask"):
                started = super()._start_workers(worker_group)
            else:
                previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))
                try:
                    started = super()._start_workers(worker_group)
                finally:
                    signal.pthread_sigmask(signal.SIG_SETMASK, previous)
            _announce_teardown(getattr(self, "_pcontext", None), judge)
            return started

        def _rendezvous(self, worker_group: Any) -> Any:
            if nodes is None:
                return super()._rendezvous(worker_group)
            with nodes.rendezvous(getattr(worker_group.spec, "rdzv_handler", None)):
                return super()._rendezvous(worker_group)

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            state = getattr(getattr(result, "state", None), "name", "")
            if nodes is not None and state in ("SUCCEEDED", "FAILED", "UNHEALTHY"):
                nodes.workers_ended(state == "SUCCEEDED")
            if state in ("FAILED", "UNHEALTHY") and judge.stopped(result):
                self._remaining_restarts = 0  # a deliberate stop is not retried
            return result

    setattr(api, "LocalElasticAgent", Agent)  # noqa: B010  (not exported to the type checker)
    try:
        yield
    finally:
        setattr(api, "LocalElasticAgent", base)  # noqa: B010


def _announce_teardown(context: Any, judge: StopJudge) -> None:
    """Make ``context`` (torchrun's processes of one round) call ``judge.teardown`` with
    its workers' pids before its ``close`` signals them: the one place every teardown
    of torchrun's goes through (a failed worker seen, a restart, the agent's exit)."""
    close = getattr(context, "close", None)
    pids = getattr(context, "pids", None)
    if not callable(close) or not callable(pids):
        return

    def closing(*args: Any, **kwargs: Any) -> Any:
        with suppress(Exception):  # best-effort: the teardown itself must go on
            judge.teardown(pids().values())
        return close(*args, **kwargs)

    context.close = closing
