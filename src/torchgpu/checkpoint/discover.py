"""Finding checkpoints on disk: ``latest``, the newest complete one, pruning.

A directory counts as a checkpoint only when it is complete (its manifest lists files
that all exist with the recorded sizes) and is not one of our temporaries.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from torchgpu.checkpoint import atomic
from torchgpu.checkpoint.layout import (
    FORMAT,
    MANIFEST_FILE,
    MODEL_FILE,
    STATE_FILE,
    is_complete,
    read_meta,
    step_of,
)

LATEST = "latest"


def list_checkpoints(parent: Path) -> list[Path]:
    """Complete checkpoint directories directly inside ``parent``, oldest first
    (by the step in meta.json, then modification time)."""
    if not parent.is_dir():
        return []
    found = [entry for entry in parent.iterdir()
             if entry.is_dir() and not atomic.is_temporary(entry.name)
             and not entry.name.startswith(".") and is_complete(entry)]
    return sorted(found, key=step_of)


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint directory ``path`` designates, or ``None`` when there is none.

    ``path`` may be a checkpoint directory (returned as is, even if damaged, so that
    loading it reports what is wrong), the directory holding them (its ``latest``
    file is followed; if that names a missing or incomplete directory, the newest
    complete one is used with a warning), or a run directory with a ``checkpoints/``
    subdirectory. Orphan temporaries (left by dead writers on this host) are never
    returned, and are deleted.
    """
    path = Path(path)
    if not path.is_dir():
        return None
    if any((path / name).exists() for name in (MANIFEST_FILE, MODEL_FILE, STATE_FILE)):
        # Named explicitly: returned as is, so loading reports exactly what is damaged
        # instead of silently using another checkpoint.
        return path
    if not (path / LATEST).exists() and (path / "checkpoints").is_dir():
        path = path / "checkpoints"
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
