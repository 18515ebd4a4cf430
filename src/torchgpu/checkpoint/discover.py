"""Finding checkpoints on disk: what a given path is (:func:`locate`, the one resolver
every command and loader uses), ``latest``, the newest complete one, pruning, and
setting aside the checkpoints of an abandoned branch.

A directory counts as a checkpoint only when it is complete (its manifest lists files
that all exist with the recorded sizes) and is not one of our temporaries. "Newest"
means most recently committed (:func:`~torchgpu.checkpoint.layout.commit_order`), not
highest step: after a resume from an earlier step the lower steps are the newer saves.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from torchgpu.checkpoint import atomic, files
from torchgpu.checkpoint.layout import (
    FORMAT,
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    commit_order,
    read_meta,
)
from torchgpu.checkpoint.manifest import is_complete, read_manifest, verify_directory
from torchgpu.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError

LATEST = "latest"
RUN_CHECKPOINTS = "checkpoints"
RUN_MODEL = MODEL_FILE  # a finished `torchgpu train` run's final weights, beside checkpoints/
# Files only a torchgpu checkpoint directory holds. Not model.safetensors: a finished run
# directory and a Hugging Face directory hold one too.
_MARKERS = (MANIFEST_FILE, STATE_FILE, META_FILE)
# The names save_checkpoint's callers give checkpoint directories (train: step-SSSSSSSS).
_STEP_NAME = re.compile(r"step-\d{8,}")
_WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin",
            "model.bin", "model.pt", "model.pth")

PathKind = Literal["missing", "file", "checkpoint", "checkpoints", "run", "weights"]


@dataclass(frozen=True)
class Located:
    """What a user-given checkpoint path is (:func:`locate`).

    ``kind``: ``missing``; ``file`` (one weights file); ``checkpoint`` (a torchgpu
    checkpoint directory, complete or damaged); ``checkpoints`` (a directory holding
    checkpoint directories, usually with ``latest``); ``run`` (a ``torchgpu train --out``
    directory: ``checkpoints/`` inside, and ``model.safetensors`` beside it once the run
    finished); ``weights`` (a directory of weights in another layout: Hugging Face,
    Accelerate, or a run that saved no checkpoint). ``parent``: where the checkpoints
    are (``checkpoints`` and ``run``). ``final_model``: a run's final weights file.
    """

    path: Path
    kind: PathKind
    parent: Path | None = None
    final_model: Path | None = None


def locate(path: str | Path) -> Located:
    """Classify ``path`` -- the one resolver behind every command and loader that takes
    a checkpoint path (``ckpt inspect|convert|verify``, ``--resume``,
    :func:`~torchgpu.checkpoint.load_checkpoint`, :func:`~torchgpu.checkpoint.load_state_dict`).

    Symbolic links are followed. A directory is a ``checkpoint`` when it holds
    manifest.json, state.pt or meta.json; else ``checkpoints`` when it holds ``latest``;
    else a ``run`` when it holds a ``checkpoints/`` directory; else a ``checkpoint``
    again when it is one whose manifest, state and meta were all deleted (a
    model.safetensors where torchgpu keeps checkpoints: ``step-NNNNNNNN``, named by
    ``latest``, inside ``checkpoints/``), which loading then refuses like a missing
    manifest instead of reading unverifiable weights; else ``weights`` when it holds a
    known weights file; else ``checkpoints`` (checkpoint directories without a
    ``latest``, or nothing). A missing path whose writer died between the two renames of
    an overwrite is restored first. A FIFO, device or socket, a link loop, a name too
    long or a permission denied is a :class:`~torchgpu.errors.CheckpointFormatError`
    naming the path; nothing is read.
    """
    path = Path(path)
    kind = files.kind_of(path)
    if kind == "missing" and atomic.restore_moved_aside(path):
        kind = files.kind_of(path)
    if kind == "missing":
        return Located(path, "missing")
    if kind == "other":
        files.check_regular(path)  # raises the error naming what it is
    if kind == "file":
        return Located(path, "file")
    if any(files.exists(path / name) for name in _MARKERS):
        return Located(path, "checkpoint")
    if files.exists(path / LATEST):
        return Located(path, "checkpoints", parent=path)
    if files.kind_of(path / RUN_CHECKPOINTS) == "dir":
        final = path / RUN_MODEL
        return Located(path, "run", parent=path / RUN_CHECKPOINTS,
                       final_model=final if files.kind_of(final) == "file" else None)
    if _stripped_checkpoint(path):
        return Located(path, "checkpoint")
    if any(files.exists(path / name) for name in _WEIGHTS):
        return Located(path, "weights")
    return Located(path, "checkpoints", parent=path)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether ``path`` is a torchgpu checkpoint directory itself, complete or damaged
    (it holds a manifest, state or meta file, or is one stripped of all three; see
    :func:`locate`)."""
    return files.kind_of(path) == "dir" and (
        any(files.exists(path / name) for name in _MARKERS) or _stripped_checkpoint(path))


def _stripped_checkpoint(directory: Path) -> bool:
    """Whether ``directory`` holds a model.safetensors but none of manifest, state and
    meta while sitting where torchgpu keeps checkpoints: named ``step-NNNNNNNN``, named
    by its parent's ``latest``, or inside a ``checkpoints/`` directory that holds a
    ``latest`` or another torchgpu checkpoint.

    Such a directory is a torchgpu checkpoint whose other files were deleted; read as a
    plain weights directory it would load its (unverifiable, maybe altered) weights
    silently, so :func:`locate` calls it a checkpoint and loading it then refuses, as for
    a deleted manifest. Every name is looked at both as given and with links resolved.
    """
    if files.kind_of(directory / MODEL_FILE) != "file":
        return False
    given = Path(os.path.abspath(directory))
    try:
        real = Path(os.path.realpath(directory))
    except (OSError, ValueError):
        real = given
    for place in dict.fromkeys((given, real)):
        if _STEP_NAME.fullmatch(place.name):
            return True
        parent = place.parent
        with contextlib.suppress(CheckpointError):  # a bad `latest` is reported elsewhere
            if atomic.read_pointer(parent, LATEST) == place.name:
                return True
        if parent.name == RUN_CHECKPOINTS and _holds_checkpoints(parent, place.name):
            return True
    return False


def _holds_checkpoints(parent: Path, besides: str) -> bool:
    """Whether ``parent`` holds a ``latest`` or a torchgpu checkpoint other than
    ``besides`` (unreadable entries are skipped)."""
    with contextlib.suppress(CheckpointError):
        if files.exists(parent / LATEST):
            return True
        return any(entry.name != besides and _is_dir(entry)
                   and any(files.exists(entry / name) for name in _MARKERS)
                   for entry in files.list_dir(parent))
    return False


def list_checkpoints(parent: Path) -> list[Path]:
    """Complete checkpoint directories directly inside ``parent``, oldest commit first
    (``created_unix_s`` in meta.json, then modification time, then step)."""
    if files.kind_of(parent) != "dir":
        return []
    found = [entry for entry in files.list_dir(parent)
             if not atomic.is_temporary(entry.name) and not entry.name.startswith(".")
             and _is_dir(entry) and is_complete(entry)]
    return sorted(found, key=commit_order)


def _is_dir(entry: Path) -> bool:
    """Whether ``entry`` (inside a listed directory) is a directory; an entry that cannot
    be examined (a link loop) is not one, so one bad entry does not hide the others."""
    try:
        return files.kind_of(entry) == "dir"
    except CheckpointError:
        return False


def find_checkpoint(path: str | Path) -> Path | None:
    """The checkpoint directory ``path`` designates (see :func:`locate`), or ``None``
    when there is none.

    A checkpoint directory is returned as is, even if damaged, so that loading it
    reports what is wrong. For a directory of checkpoints or a run directory, its
    ``latest`` file is followed; if that names a missing or incomplete directory, the
    newest complete one is used with a warning. A run directory's final
    ``model.safetensors`` is not a checkpoint (it has no training state): the
    checkpoints in its ``checkpoints/`` are used. Orphan temporaries (left by dead
    writers on this host) are never returned, and are deleted; an old checkpoint a dead
    writer had moved aside to overwrite it, and whose replacement never landed, is
    renamed back first. A ``latest`` holding anything but one plain name, and any path
    that cannot be examined, is a :class:`~torchgpu.errors.CheckpointFormatError`.
    """
    located = locate(path)
    if located.kind == "checkpoint":
        # Named explicitly: returned as is, so loading reports exactly what is damaged
        # instead of silently using another checkpoint.
        return located.path
    if located.parent is None:
        return None
    parent = located.parent
    atomic.clean_orphans(parent)
    name = atomic.read_pointer(parent, LATEST)
    if name is not None:
        target = parent / name
        if _is_dir(target):
            # Incomplete (CheckpointCorruptError): the fallback below. A
            # CheckpointFormatError (no permission, not a regular file) propagates: the
            # environment, not the checkpoint, is wrong, and a fallback would hide it.
            with contextlib.suppress(CheckpointCorruptError):
                read_manifest(target)
            if is_complete(target):
                return target
        newest = _newest(parent)
        if newest is not None:
            warnings.warn(
                f"{parent / LATEST} names {name!r}, which is missing or incomplete; using the "
                f"newest complete checkpoint {newest.name!r} instead", UserWarning, stacklevel=2)
        return newest
    return _newest(parent)


def designated_for_verify(path: Path) -> Path:
    """The checkpoint directory :func:`~torchgpu.checkpoint.verify_checkpoint` checks for
    ``path``: ``path`` itself when it is one; for a directory of checkpoints or a run
    directory, the one ``latest`` names -- a ``latest`` naming nothing is a
    :class:`CheckpointCorruptError`, not a fallback, since that is the checkpoint a
    resume would want -- else the newest complete one. A path with no torchgpu
    checkpoint is a :class:`CheckpointFormatError`."""
    located = locate(path)
    if located.kind == "checkpoint":
        return located.path
    if located.kind == "missing":
        raise CheckpointFormatError(f"{files.show(path)}: no such file or directory. Check "
                                    "the path")
    parent = located.parent
    if parent is not None and files.exists(parent / LATEST):
        name = atomic.read_pointer(parent, LATEST)
        target = parent / name if name is not None else None
        if target is not None and is_checkpoint_dir(target):
            return target
        what = f"names {name!r}, which is not a checkpoint directory" if name else "is empty"
        good = newest_verified(parent)
        raise CheckpointCorruptError(
            f"{files.show(parent / LATEST)} {what}: the latest checkpoint is missing. "
            + (f"The newest checkpoint that verifies is {files.show(good)}; use it (e.g. "
               f"--resume {files.show(good)})" if good is not None
               else "No checkpoint there verifies"))
    newest = _newest(parent) if parent is not None else None
    if newest is None:
        raise CheckpointFormatError(
            f"{files.show(path)} holds no torchgpu checkpoint (no manifest.json, no 'latest', "
            "no complete checkpoint directory inside); verify checks torchgpu checkpoint "
            "directories. Inspect other files with `torchgpu ckpt inspect`")
    return newest


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
    if files.kind_of(parent) != "dir":
        return []
    return sorted(entry for entry in files.list_dir(parent)
                  if not entry.name.startswith(".") and _is_dir(entry)
                  and any(files.exists(entry / name) for name in _MARKERS))


def newest_verified(parent: Path, exclude: Path | None = None) -> Path | None:
    """The most recently committed checkpoint in ``parent`` (other than ``exclude``)
    whose files all match their manifest (sha256), or ``None``. Reads every byte of the
    checkpoints it tries, so it is for error paths."""
    for directory in reversed(list_checkpoints(parent)):
        if exclude is not None and directory.resolve() == exclude.resolve():
            continue
        try:
            verify_directory(directory)
        except CheckpointError:  # damaged, or unreadable: either way not one to offer
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


def verify_checkpoint(path: str | Path) -> dict[str, int]:
    """Check every file of the checkpoint ``path`` designates against its manifest (size
    and sha256); returns ``{file name: size_bytes}``.

    ``path`` is a checkpoint directory, or -- resolved like every loader does
    (:func:`designated_for_verify`) -- a directory of
    checkpoints or a ``torchgpu train`` run directory: the checkpoint its ``latest``
    names is checked (a ``latest`` naming a missing one is damage, never a fallback),
    else the newest complete one. A missing, truncated or altered file, a directory where
    a file is listed, a missing or malformed manifest, or a ``latest`` naming nothing
    raises :class:`CheckpointCorruptError` naming it; a path holding no torchgpu
    checkpoint, or a file that cannot be read (permissions, a FIFO or device) raises
    :class:`CheckpointFormatError` naming it."""
    return verify_directory(designated_for_verify(Path(path)))
