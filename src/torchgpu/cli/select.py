"""``torchgpu select -n N [--min-free SIZE] [--max-util PCT]``: GPU ids for CUDA_VISIBLE_DEVICES.

Prints the chosen ids comma-separated (``0,3``), so that
``CUDA_VISIBLE_DEVICES=$(torchgpu select -n 2) python train.py`` works. Picks the ``N``
GPUs with the most free memory among those with at least ``--min-free`` free
(``8GiB``, ``500MB``) and at most ``--max-util`` percent busy. Exit 3, with the reason
for each GPU on stderr, when fewer than ``N`` qualify; exit 2 for bad flags.
Imports torch only where NVML is unavailable and torch is a CUDA build (then torch
counts the GPUs).
"""

from __future__ import annotations

from torchgpu.cli.common import ArgumentParser, fail
from torchgpu.devices.selection import select_devices
from torchgpu.errors import UsageError
from torchgpu.sizes import parse_size


def _parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="torchgpu select",
        description="Print ids of the N GPUs with the most free memory, for "
        "CUDA_VISIBLE_DEVICES=$(torchgpu select -n 2).",
    )
    parser.add_argument("-n", type=int, default=1, metavar="N", help="how many GPUs (default 1)")
    parser.add_argument("--min-free", metavar="SIZE", help="at least this much free, e.g. 8GiB")
    parser.add_argument("--max-util", type=float, metavar="PCT", help="at most this busy, 0..100")
    return parser


def main(argv: list[str]) -> int:
    # Negative-looking values reach the flags' checks instead of argparse's "expected
    # one argument" (-n -1 and --max-util -5 are plain numbers argparse already takes).
    args = _parser().parse_args(argv)
    if args.n < 1:
        return fail(f"-n {args.n} must be at least 1, e.g. -n 2")
    try:
        min_free = parse_size(args.min_free) if args.min_free is not None else None
    except UsageError as error:
        return fail(f"--min-free: {error}")
    ids = select_devices(args.n, min_free=min_free, max_util=args.max_util, init_cuda=True)
    print(",".join(str(i) for i in ids))
    return 0
