"""``torchgpu ckpt inspect|convert|verify``: look at, rewrite and check checkpoints.

Exit codes: 0 ok; 1 a checkpoint whose bytes do not match its manifest (verify); 2 bad
input -- a missing, unknown, malformed or unsafe file, or bad flags. Never a traceback
for a bad file; a fallback (``latest`` naming a missing checkpoint) is one ``note:`` line
on stderr, not a Python warning.

``verify`` of a run directory or a directory of checkpoints checks the checkpoint its
``latest`` names -- the one ``--resume`` would load -- never a fallback: a damaged or
missing one is exit 1, with the newest checkpoint that verifies as a hint. Without a
``latest`` it checks every checkpoint directory there.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from torchgpu.cli.common import ArgumentParser, fail
from torchgpu.errors import EXIT_FAILURE, EXIT_USAGE, CheckpointCorruptError

T = TypeVar("T")


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="torchgpu ckpt", description=(
        "Inspect, convert and verify checkpoints: torchgpu checkpoint directories, "
        "safetensors, torch.save files (.pt .pth .bin .ckpt), Lightning, Fabric and "
        "Accelerate outputs. Pickles are read weights-only unless --trust-checkpoint."))
    sub = parser.add_subparsers(dest="action", metavar="inspect|convert|verify",
                                parser_class=ArgumentParser)
    sub.required = True
    inspect = sub.add_parser("inspect", help="format, keys, shapes, dtypes, prefixes, globals")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="print the full report as JSON")
    inspect.add_argument("--keys", type=int, default=20, metavar="N",
                         help="tensors to list in the text report (default 20)")
    convert = sub.add_parser("convert", help="rewrite as plain or DataParallel-layout weights")
    convert.add_argument("src", type=Path)
    convert.add_argument("dst", type=Path)
    convert.add_argument("--to", choices=("plain", "dp"), default="plain",
                         help="plain: canonical keys; dp: 'module.' keys (nn.DataParallel)")
    convert.add_argument("--format", choices=("safetensors", "pt", "dcp"), default=None,
                         help="output format (default: from DST's suffix, else safetensors); "
                         "dcp: a sharded checkpoint directory (torch.distributed.checkpoint). "
                         "A sharded SRC is gathered into one file")
    convert.add_argument("--trust-checkpoint", action="store_true",
                         help="unpickle SRC fully even if it needs unsafe globals (runs code)")
    convert.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    verify = sub.add_parser("verify", help="check files against the manifest (of the checkpoint "
                            "`latest` names, for a run or checkpoints directory)")
    verify.add_argument("path", type=Path)
    return parser


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"  # pragma: no cover


def _print_report(info: dict[str, Any], show_keys: int) -> None:
    print(f"path:    {info['path']}")
    print(f"format:  {info['format']}" + (f" (weights under {info['container']!r})"
                                           if info.get("container") else ""))
    if info.get("format") == "torchgpu-dir":
        print(f"step:    {info.get('step')}   epoch: {info.get('epoch')}   "
              f"complete: {'yes' if info.get('complete') else 'NO'}")
        config = info.get("meta", {}).get("config")
        if config is not None:
            print(f"config:  {json.dumps(config, sort_keys=True)}")
    if "unsafe_globals" in info:
        bad = info["unsafe_globals"]
        print("globals: " + ("UNSAFE, would import " + ", ".join(bad) if bad
                             else "weights-only safe"))
    if info.get("note"):
        print(f"note:    {info['note']}")
    if "num_tensors" not in info:
        return
    print(f"tensors: {info['num_tensors']}   total: {_human(info['total_bytes'])}   dtypes: "
          + ", ".join(f"{k} x{v}" for k, v in info["dtypes"].items()))
    prefixes = info.get("wrapper_prefixes") or []
    print("wrapper prefixes: " + (" ".join(prefixes) if prefixes else "none (canonical keys)"))
    if info.get("aliases"):
        print("tied:    " + ", ".join(f"{a} = {s}" for a, s in info["aliases"].items()))
    print("groups:")
    for name, group in info["groups"].items():
        print(f"  {name:<24} {group['num_tensors']:>5} tensors  {_human(group['bytes']):>10}")
    rows = info.get("tensors", [])
    if show_keys > 0 and rows:
        print("keys:")
        for row in rows[:show_keys]:
            print(f"  {row['key']:<48} {row['dtype']:<9} {row['shape']}")
        if len(rows) > show_keys:
            print(f"  ... {len(rows) - show_keys} more (--keys N or --json for all)")


def _with_notes(call: Callable[[], T]) -> T:
    """Run ``call``, printing the warnings it raises as ``note:`` lines on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return call()
        finally:
            for warning in caught:
                print(f"note: {warning.message}", file=sys.stderr)


def _verify_targets(path: Path) -> list[Path] | str:
    """The checkpoint directories ``ckpt verify PATH`` checks, or why it cannot (exit 1).
    ``PATH`` is resolved like everywhere else (:func:`~torchgpu.checkpoint.discover.locate`):
    a run directory's final model.safetensors is not a checkpoint; its ``checkpoints/`` are
    what is verified."""
    from torchgpu.checkpoint import atomic, files
    from torchgpu.checkpoint.discover import LATEST, checkpoint_dirs, locate, newest_verified

    located = locate(path)
    if located.kind == "checkpoint":
        return [path]
    parent = located.parent
    if parent is None:  # a weights file or a directory of weights: no manifest to check
        return []
    if not files.exists(parent / LATEST):
        return checkpoint_dirs(parent)
    name = atomic.read_pointer(parent, LATEST)
    if name is not None and files.exists(parent / name):
        return [parent / name]
    good = newest_verified(parent)
    what = f"names {name!r}, which does not exist" if name else "is empty"
    return (f"{parent / LATEST} {what}: the latest checkpoint of the run is missing. "
            + (f"The newest checkpoint that verifies is {good}; resume from it with --resume "
               f"{good}" if good is not None else "No checkpoint there verifies"))


def _shards_line(directory: Path) -> str:
    """``; sharded: ...`` for a sharded checkpoint (its shard metadata checked), else ''."""
    from torchgpu.checkpoint.sharded_load import describe_shards, is_sharded

    if not is_sharded(directory):
        return ""
    info = describe_shards(directory)
    return (f"; sharded: {info['shard_files']} shard files, {_human(info['shard_bytes'])}, "
            f"written by {info['world_size']} rank(s), {info['model_entries']} model and "
            f"{info['optimizer_entries']} optimizer entries")


def _verify(path: Path) -> int:
    from torchgpu.checkpoint.discover import newest_verified
    from torchgpu.checkpoint.files import exists, show
    from torchgpu.checkpoint.manifest import verify_directory

    if not exists(path):
        return fail(f"{show(path)}: no such file or directory. Check the path", EXIT_USAGE)
    targets = _verify_targets(path)
    if isinstance(targets, str):
        return fail(targets, EXIT_FAILURE)
    if not targets:
        return fail(f"{show(path)} holds no torchgpu checkpoint (no manifest.json, no "
                    "'latest', no checkpoint directory inside); verify checks torchgpu "
                    "checkpoint directories. Use `torchgpu ckpt inspect` for other files",
                    EXIT_USAGE)
    problems = []
    for directory in targets:
        try:
            checked = verify_directory(directory)
        except CheckpointCorruptError as error:
            problems.append(str(error))
            continue
        try:
            shards = _shards_line(directory)
        except CheckpointCorruptError as error:
            problems.append(str(error))
            continue
        print(f"ok: {directory} ({len(checked)} files, {_human(sum(checked.values()))}, "
              f"sha256 verified{shards})")
    if not problems:
        return 0
    if len(targets) == 1 and targets[0] != path:  # reached through `latest`: offer another
        good = newest_verified(targets[0].parent, exclude=targets[0])
        if good is not None:
            problems[0] += (f". The newest checkpoint that verifies is {good}; resume from it "
                            f"with --resume {good}")
    if len(targets) > 1:
        problems[0] = f"{len(problems)} of {len(targets)} checkpoints are damaged: {problems[0]}"
    return fail("; ".join(problems), EXIT_FAILURE)


def main(argv: list[str]) -> int:
    """Entry point of ``torchgpu ckpt``."""
    args = _parser().parse_args(argv)
    from torchgpu.checkpoint import convert_checkpoint, inspect_checkpoint

    if args.action == "inspect":
        if args.keys < 0:
            return fail(f"--keys {args.keys} is negative; pass the number of tensors to list "
                        "(0 for none)", EXIT_USAGE)
        info = _with_notes(lambda: inspect_checkpoint(args.path))
        if args.json:
            print(json.dumps(info, indent=2, sort_keys=True, default=str))
        else:
            _print_report(info, args.keys)
        return 0
    if args.action == "convert":
        result = _with_notes(lambda: convert_checkpoint(
            args.src, args.dst, to=args.to, fmt=args.format, trust=args.trust_checkpoint,
            overwrite=args.force))
        changes = []
        if result.stripped:
            changes.append(f"removed prefix {result.stripped!r}")
        if result.added:
            changes.append(f"added prefix {result.added!r}")
        print(f"wrote {result.path} ({result.fmt}, {result.to} layout, {result.num_entries} "
              f"entries{'; ' + ', '.join(changes) if changes else ''})")
        return 0
    return _verify(args.path)
