"""Finding checkpoints on disk: ``latest``, the newest complete one, pruning, and
setting aside the checkpoints of an abandoned branch.

A directory counts as a checkpoint only when it is complete (its manifest lists files
that all exist with the recorded sizes) and is not one of our temporaries. "Newest"
means most recently committed (:func:`~torchgpu.checkpoint.layout.commit_order`), not
highest step: after a resume from an earlier step the lower steps are the newer saves.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from torchgpu.checkpoint import atomic
from torchgpu.checkpoint.layout import (
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    STATE_FILE,
    commit_order,
    is_complete,
    read_meta,
    verify_checkpoint,
)
from torchgpu.errors import CheckpointCorruptError

LATEST = "latest"
_MARKERS = (MANIFEST_FILE, MODEL_FILE, STATE_FILE)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether ``path`` is a checkpoint directory itself, complete or damaged (it holds a
    manifest, model or state file)."""
    return path.is_dir() and any((path / name).exists() for name in _MARKERS)


def checkpoints_parent(path: Path) -> Path:
    """The directory holding the checkpoints that ``path`` designates: ``path`` itself,
    or its ``checkpoints/`` subdirectory when ``path`` is a run directory (no ``latest``
    of its own, a ``checkpoints/`` inside)."""
    if not (path / LATEST).exists() and (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def list_checkpoints(parent: Path) -> list[Path]:
    """Complete checkpoint directories directly inside ``parent``, oldest commit first
    (``created_unix_s`` in meta.json, then modification time, then step)."""
    if not parent.is_dir():
        return []
    found = [entry for entry in parent.iterdir()
             if entry.is_dir() and not atomic.is_temporary(entry.name)
             and not entry.name.startswith(".") and is_complete(entry)]
    return sorted(found, key=commit_order)


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint directory ``path`` designates, or ``None`` when there is none.

    ``path`` may be a checkpoint directory (returned as is, even if damaged, so that
    loading it reports what is wrong), the directory holding them (its ``latest``
    file is followed; if that names a missing or incomplete directory, the newest
    complete one is used with a warning), or a run directory with a ``checkpoints/``
    subdirectory. Orphan temporaries (left by dead writers on this host) are never
    returned, and are deleted; an old checkpoint a dead writer had moved aside to
    overwrite it, and whose replacement never landed, is renamed back first.
    """
    path = Path(path)
    if not path.is_dir() and not atomic.restore_moved_aside(path):
        return None
    if is_checkpoint_dir(path):
        # Named explicitly: returned as is, so loading reports exactly what is damaged
        # instead of silently using another checkpoint.
        return path
    path = checkpoints_parent(path)
    atomic.clean_orphans(path)
    name = atomic.read_pointer(path, LATEST)
    if name is not None:
        target = path / name
        if target.is_dir() and is_complete(target):
            return target
        newest = _newest(path)
        if newest is not None:
            warnings.warn(
                f"{path / LATEST} names {name!r}, which is missing or incomplete; using the "
                f"newest complete checkpoint {newest.name!r} instead", UserWarning, stacklevel=2)
        return newest
    return _newest(path)


def _newest(parent: Path) -> Path | None:
    found = list_checkpoints(parent)
    return found[-1] if found else None


def prune(parent: Path, keep_last: int, protect: Path) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete torchgpu checkpoints in
    ``parent``; ``protect`` (the one just committed) and the one ``latest`` names are
    never deleted. Returns what was removed."""
    if keep_last < 1:
        return []
    pointed = atomic.read_pointer(parent, LATEST)
    ours = [d for d in list_checkpoints(parent) if read_meta(d).get("format") == FORMAT]
    removed = []
    for directory in ours[:-keep_last] if len(ours) > keep_last else []:
        if directory.resolve() == protect.resolve() or directory.name == pointed:
            continue
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


def checkpoint_dirs(parent: Path) -> list[Path]:
    """Checkpoint directories inside ``parent``, complete or damaged
    (:func:`is_checkpoint_dir`), by name; temporaries excluded."""
    if not parent.is_dir():
        return []
    return sorted(entry for entry in parent.iterdir()
                  if not entry.name.startswith(".") and is_checkpoint_dir(entry))


def newest_verified(parent: Path, exclude: Path | None = None) -> Path | None:
    """The most recently committed checkpoint in ``parent`` (other than ``exclude``)
    whose files all match their manifest (sha256), or ``None``. Reads every byte of the
    checkpoints it tries, so it is for error paths."""
    for directory in reversed(list_checkpoints(parent)):
        if exclude is not None and directory.resolve() == exclude.resolve():
            continue
        try:
            verify_checkpoint(directory)
        except CheckpointCorruptError:
            continue
        return directory
    return None


def later_checkpoints(parent: Path, step: int) -> list[Path]:
    """torchgpu checkpoint directories in ``parent`` (complete or not) whose meta.json
    records a step greater than ``step``, lowest step first."""
    found = []
    for directory in checkpoint_dirs(parent):
        meta = read_meta(directory)
        saved = meta.get("step")
        if meta.get("format") == FORMAT and isinstance(saved, int) and saved > step:
            found.append((saved, directory))
    return [directory for _, directory in sorted(found)]


def set_aside(parent: Path, directories: list[Path], label: str) -> Path:
    """Move ``directories`` (inside ``parent``) into a new sibling of ``parent`` named
    ``PARENT-abandoned-after-LABEL`` (``-2``, ``-3``... if taken); returns it. A
    ``latest`` in ``parent`` naming one of them is removed. Nothing is deleted."""
    destination = parent.parent / f"{parent.name}-abandoned-after-{label}"
    count = 1
    while destination.exists():
        count += 1
        destination = parent.parent / f"{parent.name}-abandoned-after-{label}-{count}"
    destination.mkdir()
    moved = set()
    for directory in directories:
        os.rename(directory, destination / directory.name)
        moved.add(directory.name)
    if atomic.read_pointer(parent, LATEST) in moved:
        (parent / LATEST).unlink()
    atomic.fsync_dir(destination)
    atomic.fsync_dir(parent)
    return destination
