"""``torchgpu bench NAME|all [--quick] [--json] [--out DIR] [--force] [--device SPEC ...]
[--threads N]``.

Runs a benchmark suite, writes results.json, report.md and PNG plots under ``--out``
(default ``runs/bench-<name>-<YYYYmmdd-HHMMSS>/``; for ``all`` one sub-directory per suite)
and prints a rich table, or the results document as JSON with ``--json``. Every output
directory is checked before any suite runs, so a bad ``--out`` leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from torchgpu.bench.suites import SUITES
from torchgpu.cli.common import ArgumentParser, int_in
from torchgpu.errors import UsageError

if TYPE_CHECKING:
    import torch  # imported by the suites once the flags parsed: --help needs none of it


def _parser() -> ArgumentParser:
    width = max(len(name) for name in SUITES)
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in SUITES.items())
    import argparse

    parser = ArgumentParser(
        prog="torchgpu bench",
        description="Measure this machine the way the seeds' experiments do, honestly: "
        "warm-up, synchronised timing, interleaved variants, median and [min..max].",
        epilog=f"suites:\n{listing}\n  {'all':<{width}}  every suite, one after another",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("suite", metavar="NAME", help="a suite name (below) or `all`")
    parser.add_argument("--quick", action="store_true",
                        help="small sizes and 2 rounds: seconds per suite (CI uses this)")
    parser.add_argument("--size", default="full", metavar="full|medium",
                        help="full: the seed's sizes (default); medium: parallel and "
                        "split-sweep at 64x64, one batch per run, 5 runs (minutes on a CPU)")
    parser.add_argument("--json", action="store_true",
                        help="print the results document as JSON instead of a table")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default runs/bench-NAME-TIME/); must be new "
                        "or empty unless --force")
    parser.add_argument("--force", action="store_true",
                        help="reuse a non-empty --out: replace an earlier run's results.json, "
                        "report.md and PNGs there")
    from torchgpu.bench.runner import THREADS_PER_CORE, max_threads

    parser.add_argument("--threads", default=None, metavar="N",
                        type=int_in("--threads", 1, max_threads(),
                                    f" ({THREADS_PER_CORE} per core of this machine)"),
                        help="torch intra-op threads per process, for in-process variants and "
                        "worker processes alike (default 1, so every variant is compared at "
                        "the same per-process budget)")
    parser.add_argument("--device", action="append", default=None, metavar="SPEC",
                        help="device(s) to measure, e.g. cpu, cuda:0 or cuda:0,cuda:1 "
                        "(repeatable; default: every GPU, else the CPU)")
    return parser


def _devices(specs: list[str] | None) -> list[torch.device] | None:
    if not specs:
        return None
    from torchgpu.devices import get_device

    chosen: list[torch.device] = []
    for group in specs:
        for spec in group.split(","):
            if spec.strip():
                device = get_device(spec.strip())
                if device not in chosen:
                    chosen.append(device)
    return chosen


def main(argv: list[str]) -> int:
    """Entry point for ``torchgpu bench``; returns the exit code."""
    from torchgpu.bench.runner import (
        DEFAULT_THREADS,
        SIZED_SUITES,
        check_size,
        check_suite,
        check_threads,
        prepare_out,
        run_suite,
    )
    from torchgpu.cli.signals import Stopped

    args = _parser().parse_args(argv)
    from torchgpu.bench.report import default_out, print_table  # matplotlib, torch

    names = list(SUITES) if args.suite == "all" else [check_suite(args.suite)]
    threads = check_threads(DEFAULT_THREADS if args.threads is None else args.threads)
    if args.quick and args.size != "full":
        raise UsageError("--quick and --size both choose a size: give one of them.")
    # `bench all --size medium` shrinks the ResNet-50 experiments and runs the rest in full.
    sizes = {n: args.size if args.suite != "all" or n in SIZED_SUITES else "full" for n in names}
    for name, size in sizes.items():
        check_size(name, size)
    devices = _devices(args.device)
    root: Path = args.out if args.out is not None else default_out(args.suite)
    if args.suite == "all" and os.path.exists(root) and not os.path.isdir(root):
        prepare_out(root)  # raises: a file where the directory should be
    outs = {name: root / name if args.suite == "all" else root for name in names}
    for out in outs.values():
        prepare_out(out, force=args.force)
    command = ["torchgpu", "bench", *argv]
    docs = []
    try:
        # SIGTERM and SIGINT raise Stopped here (torchgpu.cli.signals): the worker
        # processes are closed on the way out.
        for name in names:
            out = outs[name]
            _, doc = run_suite(
                name, args.quick, out, devices, threads=threads, argv=command,
                size=sizes[name]
            )
            docs.append(doc)
            if not args.json:
                print_table(doc, out)
    except Stopped as stopped:
        print(f"torchgpu: bench stopped by {stopped}; its worker processes were ended and "
              f"the suites finished before it are in {root}", file=sys.stderr)
        return 128 + stopped.signum
    if args.json:
        payload = docs[0] if len(docs) == 1 else {"suites": docs}
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return 0
