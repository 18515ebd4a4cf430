"""``torchgpu launch``: torchrun for your own script, on a free port by default.

    torchgpu launch --nproc 2 train.py --epochs 3
    torchgpu launch --nnodes 2 --node-rank 0 --rdzv-endpoint 10.0.0.1:29400 --nproc 8 train.py

One node: a c10d rendezvous on a free 127.0.0.1 port. Several nodes: run the same
command on every node with the same ``--rdzv-endpoint`` (torchrun's c10d rendezvous).
Inside the script, ``torchgpu.init_distributed()`` forms the group.

SIGTERM or SIGINT (Ctrl-C) to the launcher is passed on to every worker; the launcher
exits with the workers' status once they end, and kills those still running
``--stop-timeout`` seconds later. No worker outlives the launcher's exit.

Several nodes: the launcher waits ``--rdzv-timeout`` seconds for every node, then names
how many arrived; a node whose launcher disappears mid-run is named by the others, which
end their workers within seconds (torchgpu.launch.nodes).

A rank whose collective times out (``torchgpu.fit``'s ``collective_timeout``) ends every
worker, and the launcher names the hang in one paragraph; on NCCL the flight recorder's
dumps are kept in ``--flight-recorder-dir`` (default ./torchgpu-flight-recorder-<time>).
"""

from __future__ import annotations

import argparse
import os

from torchgpu.cli.common import ArgumentParser, int_in
from torchgpu.errors import UsageError
from torchgpu.launch.rendezvous import DEFAULT_RDZV_TIMEOUT_S
from torchgpu.launch.run import DEFAULT_STOP_TIMEOUT_S
from torchgpu.user_files import check_file

#: Largest --max-restarts: train's bound for counts (torchgpu.train.config.MAX_COUNT).
MAX_RESTARTS = 2**31


def _parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="torchgpu launch",
        description="Run SCRIPT under torchrun: N processes per node, free port by default.",
    )
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="processes on this node (default 1; one per GPU is usual)")
    p.add_argument("--nnodes", type=int, default=1, metavar="N", help="nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=0, metavar="R",
                   help="this node's rank (informational with c10d rendezvous)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="where the node agents meet; required with --nnodes > 1")
    p.add_argument("--rdzv-id", metavar="ID",
                   help="job id, the same on every node (default: fixed for multi-node)")
    p.add_argument("--rdzv-timeout", type=float, default=DEFAULT_RDZV_TIMEOUT_S,
                   metavar="S",
                   help="with --nnodes > 1: how long to wait for every node at the rendezvous "
                   f"before naming those missing (default {DEFAULT_RDZV_TIMEOUT_S:g})")
    p.add_argument("--max-restarts", type=int_in("--max-restarts", 0, MAX_RESTARTS), default=0,
                   metavar="R",
                   help="restart failed workers up to R times (default 0)")
    p.add_argument("--stop-timeout", type=float, default=DEFAULT_STOP_TIMEOUT_S, metavar="S",
                   help="after SIGTERM/SIGINT (passed on to the workers), kill workers still "
                   f"running S seconds later (default {DEFAULT_STOP_TIMEOUT_S:g})")
    p.add_argument("--flight-recorder-dir", metavar="DIR",
                   help="where the NCCL flight-recorder dumps of a hang are kept (default "
                   "./torchgpu-flight-recorder-<time>, made only when there are dumps)")
    p.add_argument("-m", "--module", action="store_true",
                   help="SCRIPT is a module name, run as python -m SCRIPT")
    p.add_argument("script", metavar="SCRIPT", help="the Python script to run")
    rest = p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                          help="arguments for SCRIPT")
    rest.required = False  # may be empty: a missing SCRIPT alone is named in the error
    return p


def check_module(name: str) -> None:
    """Refuse (UsageError) a ``-m`` module that ``python -m`` would not find in the
    workers (which run in this directory, with this interpreter and PYTHONPATH), found
    without importing it: a missing one was reported by every worker after torchrun
    started them, with exit code 1."""
    from importlib.machinery import ModuleSpec, PathFinder
    from importlib.util import find_spec

    parts = name.split(".")
    if not name or not all(part.isidentifier() for part in parts):
        raise UsageError(f"-m {name!r} is not a module name: use e.g. -m mypkg.train.")
    search: list[str] = []
    for depth, part in enumerate(parts):
        found: ModuleSpec | None
        if depth == 0:  # every finder (editable installs have their own), then ./
            found = find_spec(part) or PathFinder.find_spec(part, [os.getcwd()])
        else:
            found = PathFinder.find_spec(part, search)
        if found is None:
            where = ".".join(parts[:depth]) or "the Python path (this directory included)"
            raise UsageError(
                f"-m {name}: no module {'.'.join(parts[:depth + 1])!r} in {where}. Pass a "
                "module python -m can run from here (install it, or set PYTHONPATH), or a "
                "script's path without -m."
            )
        if depth < len(parts) - 1:
            search = list(found.submodule_search_locations or [])


def main(argv: list[str]) -> int:
    """``torchgpu launch [flags] SCRIPT [ARGS]``; returns the first failed worker's code."""
    from torchgpu.launch.run import LaunchSpec, check_spec, run

    ns = _parser().parse_args(argv)
    spec = LaunchSpec(
        nproc=ns.nproc, nnodes=ns.nnodes, node_rank=ns.node_rank,
        rdzv_endpoint=ns.rdzv_endpoint, rdzv_id=ns.rdzv_id,
        max_restarts=ns.max_restarts, module=ns.module, stop_timeout_s=ns.stop_timeout,
        dump_dir=ns.flight_recorder_dir, rdzv_timeout_s=ns.rdzv_timeout,
    )
    check_spec(spec)
    if ns.module:
        check_module(ns.script)
    else:
        check_file(ns.script, what="script", fix="Pass the path of a Python file (or -m "
                   "MODULE for a module).", probe=True)
    return run(spec, ns.script, list(ns.args))
