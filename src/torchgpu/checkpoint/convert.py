"""Rewriting a checkpoint as a plain or DataParallel-layout weights file.

``to="plain"`` gives canonical keys: wrapper prefixes shared by every key
(``module.``, ``_orig_mod.``, in any nesting) are removed, ``_orig_mod`` components
inside keys are dropped, and for a Lightning checkpoint the LightningModule attribute
shared by every key (``model.``) is removed too. ``to="dp"`` then adds ``module.`` --
the layout the seeds' ``_Single2Parallel`` produces and ``nn.DataParallel`` loads.
The output is written atomically (temporary file, fsync, rename). A ``.pt`` output keeps
the source's ``_metadata`` (module versions), re-keyed like the keys, so torch's
version-aware loading still upgrades old layouts; safetensors has no place for it.
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NoReturn

import torch

from torchgpu.checkpoint import atomic, files
from torchgpu.checkpoint.discover import (
    LATEST,
    RUN_CHECKPOINTS,
    find_checkpoint,
    is_checkpoint_dir,
    locate,
)
from torchgpu.checkpoint.files import show
from torchgpu.checkpoint.inspect import common_prefix, wrapper_prefixes
from torchgpu.checkpoint.keys import candidate_states, normalize, remap_metadata
from torchgpu.checkpoint.layout import split_shared, torch_bytes
from torchgpu.checkpoint.module_metadata import metadata_of, with_metadata
from torchgpu.checkpoint.sources import read_weights
from torchgpu.errors import CheckpointError, CheckpointFormatError

_LIGHTNING_MARKERS = ("pytorch-lightning_version", "lightning_version", "lightning")


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_checkpoint` wrote: the file, its format and layout, the
    number of entries, and the prefix it removed / added."""

    path: Path
    fmt: str
    to: str
    num_entries: int
    stripped: str
    added: str
    container: str


def _pick_state(obj: object) -> tuple[str, dict[str, object]]:
    candidates = candidate_states(obj)
    if not candidates:
        raise CheckpointFormatError(
            "the source holds no state dict (no mapping of names to tensors at the top level or "
            "under keys such as 'state_dict' or 'model'); nothing to convert")
    return max(candidates, key=lambda c: len(c[1]))


def canonical_keys(obj: object) -> tuple[dict[str, object], str, str]:
    """``(state, stripped prefix, container)``: the state dict inside ``obj`` with wrapper
    (and, for Lightning, attribute) prefixes removed."""
    container, state = _pick_state(obj)
    keys = [normalize(k) for k in state]
    stripped = "".join(p for p in wrapper_prefixes(keys) if p != "_orig_mod.")
    keys = [k[len(stripped):] for k in keys]
    lightning = (isinstance(obj, Mapping) and container == "state_dict"
                 and any(marker in obj for marker in _LIGHTNING_MARKERS))
    if lightning:
        shared = common_prefix(keys).split(".")[0]
        if shared:
            keys = [k[len(shared) + 1:] for k in keys]
            stripped += f"{shared}."
    if len(set(keys)) != len(keys):
        raise CheckpointError(
            "removing the wrapper prefixes would give two entries the same name; the source "
            "mixes wrapped and unwrapped keys. Load it with load_state_dict into your model and "
            "save that instead")
    saved = metadata_of(state)
    metadata = remap_metadata(saved, stripped, "") if saved is not None else None
    return (with_metadata(dict(zip(keys, state.values(), strict=True)), metadata), stripped,
            container)


def _infer_fmt(dst: Path) -> str:
    return "pt" if dst.suffix in (".pt", ".pth", ".bin", ".ckpt") else "safetensors"


def _forms(path: Path) -> list[Path]:
    """``path`` made absolute as spelled (``..`` folded) and with every link resolved:
    a writer lands on the second, a user reads the first, and either may be what lies
    inside a protected directory (``run/checkpoints`` may be a link to another disk)."""
    spelled = Path(os.path.abspath(path))
    try:
        return list(dict.fromkeys((spelled, Path(os.path.realpath(path)))))
    except (OSError, ValueError):
        return [spelled]


def _checkpoints_dir(directory: Path) -> bool:
    """Whether ``directory`` holds a run's checkpoints: it has ``latest`` or is named
    ``checkpoints``."""
    return directory.name == RUN_CHECKPOINTS or files.exists(directory / LATEST)


def _protected(source: Path) -> tuple[list[tuple[Path, str]], set[tuple[int, int]]]:
    """What converting ``source`` must never write into or onto: ``(places, inodes)``.

    ``places`` (each a path and what it is, for the message): ``source`` itself and every
    checkpoint directory its files are read from -- for a directory source the
    checkpoint ``latest`` names (also when a finished run's final model is what is
    read); for a file inside a checkpoint directory that directory -- and every entry
    (each checkpoint, and ``latest``) of the run's checkpoints directory, also for a
    run's final model given as a file. A new file beside the checkpoints is not
    protected: it overwrites nothing. Each in both :func:`_forms`, so a checkpoint
    linked to another disk is protected there too. ``inodes``: ``(st_dev, st_ino)`` of
    every file in them (two levels deep), so a hard link to one is refused too.
    """
    located = locate(source)
    places = [(source, "the source")]
    run_checkpoints: list[Path] = []
    if located.kind == "file":
        for form in _forms(source):
            if is_checkpoint_dir(form.parent):
                places.append((form.parent, "the checkpoint directory holding the source"))
                if _checkpoints_dir(form.parent.parent):
                    run_checkpoints.append(form.parent.parent)
            elif files.kind_of(form.parent / RUN_CHECKPOINTS) == "dir":  # a run's final model
                run_checkpoints.append(form.parent / RUN_CHECKPOINTS)
    else:
        if located.final_model is not None:
            places.append((located.final_model, "the run's final model"))
        if located.parent is not None:
            run_checkpoints.append(located.parent)
            with warnings.catch_warnings():  # the fallback note comes once, from the read
                warnings.simplefilter("ignore")
                designated = find_checkpoint(source)
            if designated is not None:
                places.append((designated, "the checkpoint read"))
        if located.kind == "checkpoint" and _checkpoints_dir(source.parent):
            run_checkpoints.append(source.parent)
    for parent in dict.fromkeys(run_checkpoints):
        if files.kind_of(parent) == "dir":
            places += [(entry, "a checkpoint of the run" if files.kind_of(entry) == "dir"
                        else "a file of the run's checkpoints")
                       for entry in files.list_dir(parent)]
    inodes: set[tuple[int, int]] = set()
    for place, _ in places:
        _add_inodes(place, inodes, depth=2)
    return [(form, what) for place, what in places for form in _forms(place)], inodes


def _add_inodes(path: Path, inodes: set[tuple[int, int]], depth: int) -> None:
    """Add the identity of regular file ``path``, or of the files under directory
    ``path`` down to ``depth`` levels; what cannot be examined is skipped."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return
    if stat.S_ISREG(info.st_mode):
        inodes.add((info.st_dev, info.st_ino))
    elif stat.S_ISDIR(info.st_mode) and depth > 0:
        try:
            entries = list(os.scandir(path))
        except OSError:
            return
        for entry in entries:
            _add_inodes(Path(entry.path), inodes, depth - 1)


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def _check_destination(source: Path, target: Path, overwrite: bool) -> None:
    """Refuse a destination that cannot be written safely: a name with a NUL byte, a
    missing directory (a typo must not create directories), an existing one without
    ``overwrite``, a directory or device, and -- even with ``overwrite`` -- anything
    that, spelled as given or with links resolved on either side, is, lies inside or
    contains the source or a checkpoint directory the source is read from, or is a file
    (also a hard link to one) of the run's checkpoints (:func:`_protected`): e.g.
    ``CKPT/model.safetensors``, the very checkpoint ``latest`` names, through a
    ``checkpoints/`` that links to another disk."""
    if "\0" in str(target):
        raise CheckpointError(
            f"the destination {show(target)} contains a NUL byte, which no file name can "
            "hold; choose another destination")
    if files.kind_of(target.parent) != "dir":
        raise CheckpointError(
            f"the directory of {show(target)} ({show(target.parent)}) does not exist; create it "
            f"first (mkdir -p {show(target.parent)}) or choose another destination")
    kind = files.kind_of(target)
    if kind in ("dir", "other"):
        raise CheckpointError(
            f"{show(target)} is {'a directory' if kind == 'dir' else 'not a regular file'}; "
            "name the file to write (e.g. DIR/model.safetensors)")
    places, inodes = _protected(source)
    aimed = [*_forms(target), *(parent / target.name for parent in _forms(target.parent))]
    for form in dict.fromkeys(aimed):
        for place, what in places:
            if _overlap(form, place):
                where = ("is" if form == place else "lies inside"
                         if form.is_relative_to(place) else "contains")
                _refuse(source, target, f"{where} {what} ({show(place)})")
    if kind == "file":
        try:
            info = os.stat(target)
        except OSError as error:
            raise files.os_error(target, error, "examined") from None
        if (info.st_dev, info.st_ino) in inodes:
            _refuse(source, target, "is a hard link to a file the source or its checkpoints "
                    "hold")
        if not overwrite:
            raise CheckpointError(f"{show(target)} already exists; choose another destination "
                                  "or delete it first (or pass --force)")


def _refuse(source: Path, target: Path, why: str) -> NoReturn:
    raise CheckpointError(
        f"the destination {show(target)} {why}; converting {show(source)} there would "
        "overwrite the checkpoint being read or a file of the run's checkpoints, even with "
        "--force. Write to a path outside the source and its checkpoints")


def _to_sharded(source: Path, target: Path, to: str, trust: bool) -> ConvertResult:
    """``fmt="dcp"``: the weights of ``source`` as a new sharded checkpoint directory
    ``target`` (canonical keys; never over an existing path, which may hold a run)."""
    from torchgpu.checkpoint.sharded import save_sharded_weights

    if to != "plain":
        raise CheckpointError(f"--to {to} does not apply to --format dcp: a sharded "
                              "checkpoint holds canonical keys; drop --to")
    if "\0" in str(target) or files.kind_of(target.parent) != "dir":
        raise CheckpointError(
            f"the directory of {show(target)} does not exist; create it first or choose "
            "another destination")
    if files.kind_of(target) != "missing":
        raise CheckpointError(
            f"{show(target)} already exists; --format dcp writes a new checkpoint directory "
            "there: choose a path that does not exist yet")
    state, stripped, container = canonical_keys(read_weights(source, trust=trust))
    tensors, aliases, others = split_shared(state)
    if others:
        raise CheckpointError(
            f"entries {sorted(others)[:5]} are not tensors and cannot go into a sharded "
            "checkpoint; convert with --format pt")
    for alias, stored in aliases.items():
        tensors[alias] = tensors[stored].clone()
    save_sharded_weights(target, tensors, meta={"converted_from": str(source)})
    return ConvertResult(path=target, fmt="dcp", to=to, num_entries=len(tensors),
                         stripped=stripped, added="", container=container)


def convert_checkpoint(
    src: str | Path, dst: str | Path, to: Literal["plain", "dp"] = "plain",
    fmt: Literal["safetensors", "pt", "dcp"] | None = None, *, trust: bool = False,
    overwrite: bool = False,
) -> ConvertResult:
    """Write the weights of ``src`` (any format :func:`load_state_dict` reads) to ``dst``
    with canonical keys (``to="plain"``) or ``module.``-prefixed keys (``to="dp"``), as
    safetensors or a weights-only-loadable ``torch.save`` file (``fmt``, default from
    the suffix of ``dst``), or a sharded checkpoint directory ``dst`` (``fmt="dcp"``,
    torch.distributed.checkpoint: :mod:`torchgpu.checkpoint.sharded`; a sharded ``src``
    is read whole in this process). Tied weights are written as separate copies so any reader
    gets every key. Refuses to overwrite ``dst`` unless ``overwrite``, a ``dst`` whose
    directory does not exist (a typo must not create directories), and -- always -- a
    ``dst`` that is, lies inside or contains ``src``, a checkpoint directory ``src`` is
    read from or the run's checkpoints, spelled as given or with links resolved, or is a
    hard link to one of their files. Every refusal is a :class:`CheckpointError` naming
    the path (a NUL byte in ``dst`` included)."""
    source, target = Path(src), Path(dst)
    if to not in ("plain", "dp"):
        raise CheckpointError(f"to={to!r} is not a layout; use 'plain' or 'dp'")
    chosen = fmt or _infer_fmt(target)
    if chosen not in ("safetensors", "pt", "dcp"):
        raise CheckpointError(f"format {chosen!r} is not supported; use 'safetensors', 'pt' "
                              "or 'dcp'")
    if chosen == "dcp":
        return _to_sharded(source, target, to, trust)
    _check_destination(source, target, overwrite)
    state, stripped, container = canonical_keys(read_weights(source, trust=trust))
    added = "module." if to == "dp" else ""
    saved = metadata_of(state)  # module versions, kept for torch's version-aware loading
    metadata = remap_metadata(saved, "", added) if saved is not None else None
    state = with_metadata({added + k: v for k, v in state.items()}, metadata)
    if chosen == "pt":
        plain = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                 for k, v in state.items()}
        data = torch_bytes(with_metadata(plain, metadata))
    else:
        from safetensors.torch import save

        tensors, aliases, others = split_shared(state)
        if others:
            raise CheckpointError(
                f"entries {sorted(others)[:5]} are not tensors and cannot go into safetensors; "
                "convert with --format pt")
        for alias, stored in aliases.items():
            tensors[alias] = tensors[stored].clone()
        data = save(tensors, metadata={"format": "pt"})
    atomic.write_file_atomic(target, data)
    return ConvertResult(path=target, fmt=chosen, to=to, num_entries=len(state),
                         stripped=stripped, added=added, container=container)
