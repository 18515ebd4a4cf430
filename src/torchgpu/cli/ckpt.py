"""``torchgpu ckpt inspect|convert|verify``: look at, rewrite and check checkpoints.

Exit codes: 0 ok; 1 a checkpoint whose bytes do not match its manifest (verify); 2 bad
input -- a missing, unknown, malformed or unsafe file, or bad flags. Never a traceback
for a bad file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torchgpu.cli.common import ArgumentParser, fail
from torchgpu.errors import EXIT_FAILURE, EXIT_USAGE, CheckpointCorruptError


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
    convert.add_argument("--format", choices=("safetensors", "pt"), default=None,
                         help="output format (default: from DST's suffix, else safetensors)")
    convert.add_argument("--trust-checkpoint", action="store_true",
                         help="unpickle SRC fully even if it needs unsafe globals (runs code)")
    convert.add_argument("--force", action="store_true", help="overwrite DST if it exists")
    verify = sub.add_parser("verify", help="check every file against the manifest")
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


def main(argv: list[str]) -> int:
    """Entry point of ``torchgpu ckpt``."""
    args = _parser().parse_args(argv)
    from torchgpu.checkpoint import convert_checkpoint, inspect_checkpoint, verify_checkpoint
    from torchgpu.checkpoint.discover import find_checkpoint

    if args.action == "inspect":
        info = inspect_checkpoint(args.path)
        if args.json:
            print(json.dumps(info, indent=2, sort_keys=True, default=str))
        else:
            _print_report(info, args.keys)
        return 0
    if args.action == "convert":
        result = convert_checkpoint(args.src, args.dst, to=args.to, fmt=args.format,
                                    trust=args.trust_checkpoint, overwrite=args.force)
        changes = []
        if result.stripped:
            changes.append(f"removed prefix {result.stripped!r}")
        if result.added:
            changes.append(f"added prefix {result.added!r}")
        print(f"wrote {result.path} ({result.fmt}, {result.to} layout, {result.num_entries} "
              f"entries{'; ' + ', '.join(changes) if changes else ''})")
        return 0
    path: Path = args.path
    if not path.exists():
        return fail(f"{path}: no such file or directory. Check the path", EXIT_USAGE)
    ours = any((path / name).exists()
               for name in ("manifest.json", "model.safetensors", "state.pt"))
    directory = path if ours else find_checkpoint(path)
    if directory is None:
        return fail(f"{path} holds no torchgpu checkpoint (no manifest.json, no 'latest', no "
                    "complete checkpoint inside); verify checks torchgpu checkpoint directories. "
                    "Use `torchgpu ckpt inspect` for other files", EXIT_USAGE)
    try:
        checked = verify_checkpoint(directory)
    except CheckpointCorruptError as error:
        return fail(str(error), EXIT_FAILURE)
    total = sum(checked.values())
    print(f"ok: {directory} ({len(checked)} files, {_human(total)}, sha256 verified)")
    return 0
