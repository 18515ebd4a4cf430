"""Start N processes under torchrun (``torch.distributed.run``), in this process.

:func:`torchrun_args` builds torchrun's argument list: one node on a free loopback
port by default (c10d rendezvous), or the multi-node flags passed through
(``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, rendezvous c10d). :func:`run`
runs the elastic agent here and turns a worker failure into an exit code with a
one-line reason instead of torchrun's traceback. No home-made transport.

Signals: while :func:`run` runs, SIGTERM and SIGINT sent to the launcher (to it alone,
or to its process group: torchrun starts each worker in a session of its own, so a
group signal reaches the launcher only) are forwarded to the workers by
:class:`StopForwarder`, and the launcher keeps watching them: workers that stop
cleanly (``torchgpu train`` saves at its next step and exits 0) make it exit 0, and
whatever still runs ``LaunchSpec.stop_timeout_s`` after the signal is SIGKILLed with its
process group. Every exit of :func:`run` (a return, an exception) ends the workers.

Hangs: the workers keep heartbeats (:mod:`torchgpu.train.heartbeat`); when a rank's
collective times out (``--collective-timeout``), :class:`HangWatch` ends every worker
at once, in every round torchrun runs (``--max-restarts``), and :func:`run` prints one
paragraph naming the rank(s) that did not arrive, the step and collective, where every
rank was and its last line, and exits 1. That paragraph is the run's last word: the
timed-out ranks wait to be ended instead of printing their own errors, and torchrun's
log line for the workers the watch killed is left out.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from torchgpu.errors import UsageError
from torchgpu.train.hang_watch import HangWatch, kill_children

LOOPBACK = "127.0.0.1"
DEFAULT_STOP_TIMEOUT_S = 60.0  # seconds
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_ENDPOINT = re.compile(r"^(?P<host>[A-Za-z0-9_.\-]+|\[[^\]\s]+\]):(?P<port>\d{1,5})$")


def check_endpoint(endpoint: str) -> None:
    """Raise UsageError unless ``endpoint`` is HOST:PORT (a name, an IPv4 address or a
    bracketed IPv6 address, and a port 1..65535): the rendezvous address of
    ``torchgpu launch`` and ``torchgpu train``, refused here rather than retried by
    torchrun's agent until it times out."""
    match = _ENDPOINT.match(endpoint)
    if match is None or not 0 < int(match["port"]) <= 65535:
        raise UsageError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT with a port 1..65535, "
            "e.g. 127.0.0.1:29400, node0.cluster:29400 or [::1]:29400."
        )


@dataclass(frozen=True)
class LaunchSpec:
    """What to start: ``nproc`` processes on this node, of ``nnodes`` nodes.

    ``rdzv_endpoint`` (HOST:PORT) is required for several nodes; for one node a free
    loopback port is chosen. ``rdzv_id`` must be the same on every node of one job.
    """

    nproc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    module: bool = False  # target is a module name (python -m), not a script path
    # After a SIGTERM/SIGINT, how long the workers may take to stop (a save included)
    # before they are killed. torchrun's own grace period is 30 s.
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    # Where a hang's NCCL flight-recorder dumps are kept (train: OUT/flight_recorder);
    # None: ./torchgpu-flight-recorder-<time> under the working directory.
    dump_dir: str | None = None
    # Turn on NCCL's flight recorder for the workers; None: when this machine has CUDA.
    flight_recorder: bool | None = None


#: Processes per CPU core at most: more only time-slice the cores (each process already
#: runs its own intra-op threads) while every one holds the model and the data; a GPU
#: node has more cores than GPUs, so one process per GPU is always allowed.
PROCESSES_PER_CORE = 4


def check_process_count(nproc: int, what: str = "processes") -> None:
    """Refuse ``nproc`` above PROCESSES_PER_CORE per CPU core of this machine."""
    cores = os.cpu_count() or 1
    limit = PROCESSES_PER_CORE * cores
    if nproc > limit:
        raise UsageError(
            f"--nproc {nproc} would start {nproc} {what} on {cores} cores; at most "
            f"{limit} ({PROCESSES_PER_CORE} per core) are allowed, and more than "
            f"{cores} rarely runs faster: use --nproc {min(cores, limit)} (or fewer, e.g. "
            "one per GPU)."
        )


def check_spec(spec: LaunchSpec) -> None:
    """Raise UsageError for values torchrun would reject less clearly."""
    if spec.nproc < 1:
        raise UsageError(
            f"--nproc {spec.nproc} is out of range: start at least 1 process per node "
            "(e.g. --nproc 2, or the number of GPUs)."
        )
    check_process_count(spec.nproc)
    if spec.nnodes < 1:
        raise UsageError(f"--nnodes {spec.nnodes} is out of range: use 1 or more nodes.")
    if not 0 <= spec.node_rank < spec.nnodes:
        raise UsageError(
            f"--node-rank {spec.node_rank} is out of range for --nnodes {spec.nnodes}: "
            f"use 0..{spec.nnodes - 1}."
        )
    if spec.nnodes > 1 and not spec.rdzv_endpoint:
        raise UsageError(
            f"--nnodes {spec.nnodes} needs --rdzv-endpoint HOST:PORT where all node agents "
            "meet (the same value on every node), e.g. --rdzv-endpoint 10.0.0.1:29400."
        )
    if spec.rdzv_endpoint is not None:
        check_endpoint(spec.rdzv_endpoint)
    if spec.max_restarts < 0:
        raise UsageError(f"--max-restarts {spec.max_restarts} must be 0 or more.")
    if not spec.stop_timeout_s > 0:
        raise UsageError(
            f"--stop-timeout {spec.stop_timeout_s} is out of range: give the seconds workers "
            f"may take to stop after SIGTERM/SIGINT, more than 0 (default "
            f"{DEFAULT_STOP_TIMEOUT_S:.0f})."
        )


def torchrun_args(spec: LaunchSpec, target: str, target_args: Sequence[str]) -> list[str]:
    """The argument list for ``torch.distributed.run`` (without the program name)."""
    from torchgpu.distributed import free_port

    check_spec(spec)
    endpoint = spec.rdzv_endpoint or f"{LOOPBACK}:{free_port(LOOPBACK)}"
    host = endpoint.rsplit(":", 1)[0]
    args = [
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={spec.rdzv_id or ('torchgpu' if spec.nnodes > 1 else uuid.uuid4().hex)}",
        f"--max-restarts={spec.max_restarts}",
    ]
    if host in (LOOPBACK, "localhost"):
        # All agents on this machine: name it by the loopback address so no hostname lookup
        # (which may fail without a network) decides where workers connect.
        args.append(f"--local-addr={LOOPBACK}")
    # --node-rank is not passed on: c10d rendezvous assigns node ranks in arrival order
    # (torchrun ignores it with a warning); check_spec still validates it.
    if spec.module:
        args.append("--module")
    return [*args, target, *target_args]


def run(spec: LaunchSpec, target: str, target_args: Sequence[str]) -> int:
    """Run ``target`` under torchrun; returns 0, or the first failed worker's exit code.

    SIGTERM/SIGINT during the run are forwarded to the workers (see the module
    docstring); SIGHUP/SIGQUIT stay torchrun's (it ends the workers) and give exit code
    128 + the signal's number, with a one-line message instead of a traceback.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    # Only torchrun's own options go through its parser: argparse classifies every
    # "--x" token, even after the script, so a worker flag that abbreviates one of
    # torchrun's (--log for --log-dir) would be refused as ambiguous. The script's
    # arguments are handed over as they are.
    args = get_args_parser().parse_args(torchrun_args(spec, target, []))
    args.training_script_args = list(target_args)
    if hasattr(args, "signals_to_handle"):
        # torchrun's agent turns these signals into an exception that tears it down
        # (workers SIGKILLed after its grace period, their exit status lost, a traceback):
        # the StopForwarder handles them instead.
        args.signals_to_handle = agent_signals(args.signals_to_handle)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, without its warning
    if spec.max_restarts > 0:
        # With the agent's TCP store shared across rounds (torch >= 2.4 default), restarted
        # workers read the dead workers' gloo addresses left in it and fail with
        # "Connection refused"; a fresh store per round (rank 0 hosts it) avoids that.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    forwarder = StopForwarder(spec.stop_timeout_s)
    # Workers write heartbeats; a rank's collective timeout ends every worker at once
    # (not after torchrun's 30 s grace) and the hang is named (torchgpu.train.heartbeat).
    recorder = spec.flight_recorder
    if recorder is None:
        import torch

        recorder = torch.cuda.is_available()  # counts devices; creates no CUDA context
    watch = HangWatch(kill_children(child_pids),
                      Path(spec.dump_dir) if spec.dump_dir is not None else None, recorder)
    quiet = _QuietAfterHang(watch)
    torchrun_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torchrun_log.addFilter(quiet)
    try:
        with forwarder.installed(), watch.installed():
            try:
                torchrun(args)  # type: ignore[no-untyped-call]
            except ChildFailedError as error:
                if watch.report is None:
                    watch.report = watch.after_failure(_aborted_ranks(error))
                raise
    except ChildFailedError as error:
        hang = watch.last_word({f.pid for f in error.failures.values()})
        if hang is not None:
            print(hang, file=sys.stderr)
            return 1
        _, first = error.get_first_failure()
        code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
        # Name every failed rank: when one rank dies (killed, crashed) its peers fail in
        # the next collective a moment later, and which of them torchrun noticed first is
        # a race; the user needs the whole picture to find the cause.
        failed = "; ".join(
            f"worker rank {rank} of {target} failed ({_how(failure.exitcode)})"
            for rank, failure in sorted(error.failures.items())
        )
        print(f"torchgpu: {failed}; see their output above.", file=sys.stderr)
        if forwarder.received is not None and code == 1:
            code = 128 + int(forwarder.received)
        return int(code)
    except SignalException as error:
        sig = signal.Signals(error.sigval)
        print(f"torchgpu: stopped by {sig.name}: torchrun ended the workers (SIGTERM, then "
              "SIGKILL after its grace period) without waiting for a checkpoint; send "
              "SIGTERM or SIGINT for a saved stop.", file=sys.stderr)
        return 128 + int(sig)
    finally:
        torchrun_log.removeFilter(quiet)
    watch.last_word(())  # a round that hung, then was restarted: its paragraph is printed
    return 0


class _QuietAfterHang(logging.Filter):
    """Leaves out torchrun's "failed (exitcode: -9) ..." line for workers the hang watch
    ended: the hang's paragraph says why they stopped."""

    def __init__(self, watch: HangWatch) -> None:
        super().__init__()
        self.watch = watch

    def filter(self, record: logging.LogRecord) -> bool:
        return self.watch.report is None or not str(record.msg).startswith("failed (exitcode")


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
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        try:
            for sig in STOP_SIGNALS:
                signal.signal(sig, self._handle)
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._done.set()
            if self._watcher is not None:
                self._watcher.join(timeout=5)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if self.received is None:
            self.received = sig
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


def _aborted_ranks(error: Any) -> frozenset[int]:
    """Ranks that died of SIGABRT (NCCL's watchdog ends a rank whose collective timed out)."""
    return frozenset(rank for rank, failure in error.failures.items()
                     if failure.exitcode == -int(signal.SIGABRT))


def _how(exitcode: int) -> str:
    return f"exit code {exitcode}" if exitcode >= 0 else f"signal {-exitcode}"
