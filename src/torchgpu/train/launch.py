"""Start N processes under torchrun (``torch.distributed.run``), in this process.

:func:`torchrun_args` builds torchrun's argument list: one node on a free loopback
port by default (c10d rendezvous), or the multi-node flags passed through
(``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, rendezvous c10d). :func:`run`
runs the elastic agent here and turns a worker failure into an exit code with a
one-line reason instead of torchrun's traceback. No home-made transport.
"""

from __future__ import annotations

import os
import re
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from torchgpu.errors import UsageError

LOOPBACK = "127.0.0.1"
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


def check_spec(spec: LaunchSpec) -> None:
    """Raise UsageError for values torchrun would reject less clearly."""
    if spec.nproc < 1:
        raise UsageError(
            f"--nproc {spec.nproc} is out of range: start at least 1 process per node "
            "(e.g. --nproc 2, or the number of GPUs)."
        )
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
    """Run ``target`` under torchrun; returns 0, or the first failed worker's exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    # Only torchrun's own options go through its parser: argparse classifies every
    # "--x" token, even after the script, so a worker flag that abbreviates one of
    # torchrun's (--log for --log-dir) would be refused as ambiguous. The script's
    # arguments are handed over as they are.
    args = get_args_parser().parse_args(torchrun_args(spec, target, []))
    args.training_script_args = list(target_args)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's own default, without its warning
    if spec.max_restarts > 0:
        # With the agent's TCP store shared across rounds (torch >= 2.4 default), restarted
        # workers read the dead workers' gloo addresses left in it and fail with
        # "Connection refused"; a fresh store per round (rank 0 hosts it) avoids that.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun(args)  # type: ignore[no-untyped-call]
    except ChildFailedError as error:
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
        return int(code)
    return 0


def _how(exitcode: int) -> str:
    return f"exit code {exitcode}" if exitcode >= 0 else f"signal {-exitcode}"
