"""Start N processes under torchrun (``torch.distributed.run``), in this process.

:func:`torchrun_args` builds torchrun's argument list: one node on a free loopback
port by default (c10d rendezvous), or the multi-node flags passed through
(``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, rendezvous c10d). :func:`run`
runs the elastic agent here and turns a worker failure into an exit code with a
one-line reason instead of torchrun's traceback. No home-made transport.

Signals (:mod:`torchgpu.launch.stop`): while :func:`run` runs, SIGTERM and SIGINT sent
to the launcher (to it alone, or to its process group: torchrun starts each worker in a
session of its own, so a group signal reaches the launcher only) are forwarded to the
workers by :class:`StopForwarder`, and the launcher keeps watching them: workers that
stop cleanly (``torchgpu train`` saves at its next step and exits 0) make it exit 0, and
whatever still runs ``LaunchSpec.stop_timeout_s`` after the signal is SIGKILLed with its
process group. Every exit of :func:`run` (a return, an exception) ends the workers. A
stop signal -- to the launcher or to any worker, at any time -- is recorded in the run's
stop record (:data:`torchgpu.launch.stop_record.STOP_FILE_ENV`), and a round that a stop ended
is never restarted (``--max-restarts`` is for failures); a worker a stop signal ended is
reported as stopped, not failed, with exit code 128 + the signal's number. The SIGTERM
torchrun's agent sends the other workers after one failed is no stop
(:class:`~torchgpu.launch.stop.StopJudge`): the round failed, and is restarted.

Hangs: the workers keep heartbeats (:mod:`torchgpu.launch.heartbeat`); when a rank's
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
import shutil
import signal
import sys
import uuid
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchgpu.errors import UsageError
from torchgpu.launch.hang_watch import HangWatch, kill_children
from torchgpu.launch.nodes import NodeLostError, NodeWatch, heartbeat_steps
from torchgpu.launch.rendezvous import (
    DEFAULT_RDZV_TIMEOUT_S,
    await_store,
    rdzv_conf,
    workers_die_with_launcher,
)
from torchgpu.launch.stop import (
    StopForwarder,
    StopJudge,
    agent_signals,
    child_pids,
    signal_in,
    stop_aware_agent,
)
from torchgpu.launch.stop_record import STOP_FILE_ENV

__all__ = ["LaunchSpec", "check_endpoint", "check_process_count", "check_spec", "run",
           "torchrun_args"]

LOOPBACK = "127.0.0.1"
DEFAULT_STOP_TIMEOUT_S = 60.0  # seconds
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

    ``rdzv_endpoint`` (HOST:PORT) is required for several nodes; for one node the store
    binds a free loopback port. ``rdzv_id`` must be the same on every node of one job.
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
    # The workers are torchgpu's own entry point (``python -m torchgpu``), which takes
    # over SIGTERM/SIGINT on its first line: they are started with both blocked, so one
    # sent while a worker starts waits for its handler (torchgpu.cli.signals).
    torchgpu_workers: bool = False
    # How long this node waits for every node at the rendezvous (several nodes only).
    rdzv_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S


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


_RDZV_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


def check_rdzv_id(rdzv_id: str) -> None:
    """Raise UsageError unless ``rdzv_id`` is 1..128 letters, digits, ``.``, ``_`` or
    ``-``: torchrun names a directory after it (a ``/`` or a long id fails there)."""
    if _RDZV_ID.fullmatch(rdzv_id) is None:
        shown = rdzv_id if len(rdzv_id) <= 40 else f"{rdzv_id[:37]}... ({len(rdzv_id)} characters)"
        empty = " (an unset variable in the command?)" if not rdzv_id else ""
        raise UsageError(
            f"--rdzv-id {shown!r} is not a job id{empty}: use 1 to 128 letters, digits, '.', "
            "'_' or '-', the same on every node, e.g. --rdzv-id $SLURM_JOB_ID or "
            "--rdzv-id job-42."
        )


def check_nodes(nnodes: int, node_rank: int, rdzv_endpoint: str | None) -> None:
    """Raise UsageError unless ``nnodes``/``node_rank``/``rdzv_endpoint`` describe a job
    torchrun can start (``torchgpu launch`` and ``torchgpu train`` both ask)."""
    if nnodes < 1:
        raise UsageError(f"--nnodes {nnodes} is out of range: use 1 or more nodes.")
    if not 0 <= node_rank < nnodes:
        raise UsageError(
            f"--node-rank {node_rank} is out of range for --nnodes {nnodes}: "
            f"use 0..{nnodes - 1}."
        )
    if nnodes > 1 and not rdzv_endpoint:
        raise UsageError(
            f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT where all node agents "
            "meet (the same value on every node), e.g. --rdzv-endpoint 10.0.0.1:29400."
        )
    if rdzv_endpoint is not None:
        check_endpoint(rdzv_endpoint)


def check_spec(spec: LaunchSpec) -> None:
    """Raise UsageError for values torchrun would reject less clearly."""
    if spec.nproc < 1:
        raise UsageError(
            f"--nproc {spec.nproc} is out of range: start at least 1 process per node "
            "(e.g. --nproc 2, or the number of GPUs)."
        )
    check_process_count(spec.nproc)
    check_nodes(spec.nnodes, spec.node_rank, spec.rdzv_endpoint)
    if spec.rdzv_id is not None:
        check_rdzv_id(spec.rdzv_id)
    if spec.max_restarts < 0:
        raise UsageError(f"--max-restarts {spec.max_restarts} must be 0 or more.")
    if not 0 < spec.rdzv_timeout_s <= 2**31:
        raise UsageError(
            f"--rdzv-timeout {spec.rdzv_timeout_s:g} is out of range: give the seconds a "
            f"node waits for every node at the rendezvous, more than 0 (default "
            f"{DEFAULT_RDZV_TIMEOUT_S:.0f})."
        )
    if not spec.stop_timeout_s > 0:
        raise UsageError(
            f"--stop-timeout {spec.stop_timeout_s} is out of range: give the seconds workers "
            f"may take to stop after SIGTERM/SIGINT, more than 0 (default "
            f"{DEFAULT_STOP_TIMEOUT_S:.0f})."
        )


def torchrun_args(spec: LaunchSpec, target: str, target_args: Sequence[str]) -> list[str]:
    """The argument list for ``torch.distributed.run`` (without the program name)."""
    check_spec(spec)
    # One node: port 0, the agent's store binds a free port itself (as torchrun's
    # --standalone does); a port picked here first could be taken by another job before
    # the store binds it, and the agent would then wait on a store that never answers.
    endpoint = spec.rdzv_endpoint or f"{LOOPBACK}:0"
    host = endpoint.rsplit(":", 1)[0]
    args = [
        f"--nnodes={spec.nnodes}",
        f"--nproc-per-node={spec.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={spec.rdzv_id or ('torchgpu' if spec.nnodes > 1 else uuid.uuid4().hex)}",
        f"--max-restarts={spec.max_restarts}",
    ]
    if spec.nnodes > 1:
        args.append(f"--rdzv-conf={rdzv_conf(spec.rdzv_timeout_s)}")
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
    from torch.distributed.elastic.rendezvous.api import RendezvousError
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
    # (not after torchrun's 30 s grace) and the hang is named (torchgpu.launch.heartbeat).
    recorder = spec.flight_recorder
    if recorder is None:
        import torch

        recorder = torch.cuda.is_available()  # counts devices; creates no CUDA context
    watch = HangWatch(kill_children(child_pids),
                      Path(spec.dump_dir) if spec.dump_dir is not None else None, recorder)
    nodes = None if spec.nnodes < 2 else NodeWatch(
        args.rdzv_endpoint, args.rdzv_id, spec.nnodes, spec.rdzv_timeout_s,
        kill_children(child_pids), end_on_loss=not spec.torchgpu_workers,
        steps=lambda: heartbeat_steps(watch.directory),
        pending_stop=lambda: forwarder.received,
        before_exit=lambda: shutil.rmtree(watch.directory or "", ignore_errors=True))
    quiet = _QuietAfterHang(watch, nodes)
    torchrun_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    torchrun_log.addFilter(quiet)
    judge = StopJudge(forwarder)  # a stop, or a failure (torchrun's teardown is none)
    stop_words: list[str | None] = [None]  # the run's stop record, read before it goes
    previous_record = os.environ.get(STOP_FILE_ENV)
    try:
        # torchgpu's own workers stop with a checkpoint when their launcher dies
        # (torchgpu.launch.heartbeat); a script's workers are killed with it
        with forwarder.installed(), watch.installed(), \
                nullcontext() if spec.torchgpu_workers else workers_die_with_launcher(), \
                stop_aware_agent(spec.torchgpu_workers, judge, nodes), \
                nodes.installed() if nodes is not None else nullcontext():
            assert watch.directory is not None
            os.environ[STOP_FILE_ENV] = str(watch.directory / "stop.json")
            if getattr(args, "log_dir", None) is None:
                # torchrun's per-run directories (torchelastic_* in $TMPDIR otherwise, never
                # removed) go with the watch's directory when the launcher exits.
                args.log_dir = str(watch.directory / "torchrun")
            if nodes is not None:
                early = await_store(args.rdzv_endpoint, spec.rdzv_timeout_s,
                                    lambda: forwarder.received)
                if early is not None:
                    raise SignalException(f"{early.name} at the rendezvous", early)
            try:
                torchrun(args)  # type: ignore[no-untyped-call]
            except ChildFailedError as error:
                if nodes is not None and nodes.wait_lost() is not None:
                    raise  # the lost node's paragraph says it all
                if watch.report is None:
                    watch.report = watch.after_failure(_aborted_ranks(error))
                raise
            except RendezvousError:
                if nodes is not None:  # a store gone mid-run: its host's loss is named first
                    nodes.wait_lost()
                raise
            finally:
                stop_words[0] = judge.recorded()
                _restore(STOP_FILE_ENV, previous_record)
    except ChildFailedError as error:
        if nodes is not None and nodes.error is not None:
            raise nodes.error from None
        if nodes is not None and nodes.lost is not None:
            return 1  # the lost node's paragraph is printed
        hang = watch.last_word({f.pid for f in error.failures.values()})
        if hang is not None:
            print(hang, file=sys.stderr)
            return 1
        _, first = error.get_first_failure()
        code = first.exitcode if first.exitcode and first.exitcode > 0 else 1
        # Name every failed rank: when one rank dies (killed, crashed) its peers fail in
        # the next collective a moment later, and which of them torchrun noticed first is
        # a race; the user needs the whole picture to find the cause.
        sig = judge.signal(error.failures) or signal_in(stop_words[0])
        verb = "ended" if sig is not None else "failed"
        failed = "; ".join(
            f"worker rank {rank} of {target} {verb} ({_how(failure.exitcode)})"
            for rank, failure in sorted(error.failures.items())
        )
        if sig is not None:  # a deliberate stop, not a failure (and not restarted)
            print(f"torchgpu: stopped by {stop_words[0] or sig.name}: {failed}; see their "
                  "output above.", file=sys.stderr)
            return 128 + int(sig)
        print(f"torchgpu: {failed}; see their output above.", file=sys.stderr)
        return int(code)
    except SignalException as error:
        sig = signal.Signals(error.sigval)
        if nodes is not None and (nodes.stopped is not None or "rendezvous" in str(error)):
            print(f"torchgpu: stopped by {sig.name} at the rendezvous at "
                  f"{args.rdzv_endpoint}, before any worker started.", file=sys.stderr)
            return 128 + int(sig)
        print(f"torchgpu: stopped by {sig.name}: torchrun ended the workers (SIGTERM, then "
              "SIGKILL after its grace period) without waiting for a checkpoint; send "
              "SIGTERM or SIGINT for a saved stop.", file=sys.stderr)
        return 128 + int(sig)
    except NodeLostError:
        return 1  # its paragraph is printed
    except RendezvousError as error:
        if nodes is None:
            raise
        return nodes.rendezvous_failed(error)
    finally:
        torchrun_log.removeFilter(quiet)
    watch.last_word(())  # a round that hung, then was restarted: its paragraph is printed
    return 0


class _QuietAfterHang(logging.Filter):
    """Leaves out torchrun's "failed (exitcode: -9) ..." line for workers the hang watch
    or the node watch ended: their paragraph says why they stopped."""

    def __init__(self, watch: HangWatch, nodes: NodeWatch | None) -> None:
        super().__init__()
        self.watch, self.nodes = watch, nodes

    def filter(self, record: logging.LogRecord) -> bool:
        ended = self.watch.report is not None or (
            self.nodes is not None and (self.nodes.lost or self.nodes.error) is not None)
        return not ended or not str(record.msg).startswith("failed (exitcode")


def _restore(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _aborted_ranks(error: Any) -> frozenset[int]:
    """Ranks that died of SIGABRT (NCCL's watchdog ends a rank whose collective timed out)."""
    return frozenset(rank for rank, failure in error.failures.items()
                     if failure.exitcode == -int(signal.SIGABRT))


def _how(exitcode: int) -> str:
    return f"exit code {exitcode}" if exitcode >= 0 else f"signal {-exitcode}"
