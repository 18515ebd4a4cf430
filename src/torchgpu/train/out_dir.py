"""Whether ``--out`` can hold a run, checked before any data is loaded.

A run writes its files at the end of a long preparation (data, model, planner), so an
output directory that cannot be created must be refused first, with the reason, and
without creating anything. :func:`check_creatable` walks up to the first existing
ancestor and asks the file system itself whether a new directory can be made there.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from torchgpu.errors import UsageError
from torchgpu.train import outputs

FIX = "pass a directory you can write to, e.g. --out runs/my-run"


def _name_max(directory: Path) -> int:
    """The longest file name ``directory``'s file system allows (255 on most)."""
    try:
        return int(os.pathconf(directory, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return 255


def _stat(path: Path) -> os.stat_result | None:
    """``os.stat(path)``, or None where nothing is there (or the name is too long to
    be there: ENAMETOOLONG is reported by the length check)."""
    try:
        return os.stat(path)
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG):
            return None
        raise UsageError(
            f"--out {path} cannot be checked ({error.strerror or error}); {FIX}."
        ) from None


def cannot_make_in(parent: Path) -> str | None:
    """Why nothing can be made in directory ``parent``, or None when it can: makes and
    removes a uniquely named directory there, since only the file system knows whether
    it accepts one (``/proc``, read-only mounts, permissions, quotas). A unique name, so
    ranks probing the same place at once do not collide."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".torchgpu-probe-", dir=parent))
    except OSError as error:
        reason = error.strerror or str(error)
        if error.errno in (errno.EACCES, errno.EPERM):
            reason = f"permission denied ({reason})"
        return reason
    return None


def _probe(parent: Path, out: str) -> None:
    """Raise UsageError with the reason when no directory can be made in ``parent``."""
    reason = cannot_make_in(parent)
    if reason is not None:
        raise UsageError(
            f"--out {out} cannot be created: no directory can be made in {parent} "
            f"({reason}); {FIX}."
        )


def _check_outputs(directory: Path, out: str) -> None:
    """Raise UsageError when something other than a file (a directory, a FIFO, a
    socket) stands where the run may write one of its files in existing ``--out``
    ``directory``, or something other than a directory where it keeps a directory
    (:data:`~torchgpu.train.outputs.RUN_ENTRIES`): the run would fail only when it
    writes there, after its training."""
    for name, want_dir in outputs.RUN_ENTRIES.items():
        path = directory / name
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue  # missing (or unreadable: the write reports it with its reason)
        if stat.S_ISDIR(mode) != want_dir or not (want_dir or stat.S_ISREG(mode)):
            found = ("a directory" if stat.S_ISDIR(mode) else "a file" if stat.S_ISREG(mode)
                     else "neither a file nor a directory")
            wanted = "a directory" if want_dir else "a file"
            raise UsageError(
                f"--out {out}: {name} there is {found}, but the run writes {wanted} of that "
                f"name; nothing was written. Move {path} away, or pass another --out."
            )


def check_creatable(out: str) -> None:
    """Raise UsageError unless ``out`` is, or can become, a writable directory.

    Existing: it must be a directory this process can write to. Missing: the first
    existing ancestor must be a directory (not a regular file), each new component
    must fit the file system's name length (``PC_NAME_MAX``), and the ancestor must
    accept a new directory (probed by making and removing one). Nothing is left behind.
    """
    if not out or "\0" in out:
        raise UsageError(f"--out {out!r} is not a path: {FIX}.")
    path = Path(out).expanduser()
    absolute = Path(os.path.abspath(path))
    found = _stat(absolute)
    if found is not None:
        if not stat.S_ISDIR(found.st_mode):
            raise UsageError(
                f"--out {out} exists and is not a directory: pass a new directory for the run."
            )
        _check_outputs(absolute, out)
        _probe(absolute, out)
        return
    missing: list[str] = []
    ancestor = absolute
    while found is None and ancestor != ancestor.parent:
        missing.append(ancestor.name)
        ancestor = ancestor.parent
        found = _stat(ancestor)
    missing.reverse()
    if found is None or not stat.S_ISDIR(found.st_mode):
        raise UsageError(
            f"--out {out} cannot be created: {ancestor} is a file, not a directory, so "
            f"nothing can be made under it; {FIX}."
        )
    limit = _name_max(ancestor)
    for name in missing:
        if len(name.encode(errors="surrogateescape")) > limit:
            shown = name if len(name) <= 40 else f"{name[:20]}...{name[-10:]}"
            raise UsageError(
                f"--out {out} cannot be created: the name {shown!r} is {len(name)} characters "
                f"long and this file system allows at most {limit} per name; {FIX}."
            )
    try:
        path_max = int(os.pathconf(ancestor, "PC_PATH_MAX"))
    except (OSError, ValueError):
        path_max = 4096
    # Files go one or two levels below --out (checkpoints/step-N/model.safetensors).
    longest = len(str(absolute).encode(errors="surrogateescape")) + 64
    if longest >= path_max:
        raise UsageError(
            f"--out {out} cannot hold a run: its path is {len(str(absolute))} characters and "
            f"with the run's files inside it would pass this file system's limit of "
            f"{path_max}; {FIX}."
        )
    _probe(ancestor, out)


def check_out_dir(out: str, resuming: bool) -> Path:
    """Refuse an ``--out`` that is a file or already holds a run (unless resuming)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"--out {out} exists and is not a directory: pass a new directory for the run."
        )
    if not resuming and path.is_dir():
        taken = [n for n in (outputs.SUMMARY_FILE, outputs.METRICS_FILE) if (path / n).exists()]
        if taken:
            raise UsageError(
                f"--out {out} already holds a run ({', '.join(taken)}): pass a new --out "
                "directory, delete the old run, or continue it with --resume."
            )
    return path
