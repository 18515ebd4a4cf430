"""Whether ``--out`` can hold a run, checked before any data is loaded.

A run writes its files after a long preparation, so an ``--out`` that cannot be created is
refused first, with the reason and without creating anything (:func:`check_creatable` asks
the file system at the first existing ancestor). An ``--out`` that holds a run's files (any
of ``outputs.files.RUN_ENTRIES``) is never written over unasked: :func:`check_out_dir`
refuses it unless the run continues it (``--resume``, a torchrun restart) or
``--overwrite`` was given, and then ``clear_run`` removes those entries, and nothing
else, just before the new run writes its first file.
"""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.outputs import files as outputs

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
    (:data:`~torchgpu.train.outputs.files.RUN_ENTRIES`): the run would fail only when it
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


def check_out_dir(config: TrainConfig, *, resuming: bool) -> Path:
    """``config.out`` as a Path, unless it cannot take this run.

    The one check of whether a run may write into an existing ``--out``; ``resuming`` is
    the caller's decision that the run continues the one there (``--resume``, a torchrun
    restart), which may then write into it. Otherwise an ``--out`` holding any of the
    run's entries (:data:`~torchgpu.train.outputs.files.RUN_ENTRIES`) is refused with
    :class:`OutHoldsRun` (exit 2: how to continue it, or ``--overwrite``), unless
    ``config.overwrite``: then the runner removes them (``clear_run``) before it
    writes. A file where the directory should be is a UsageError either way. Reads only.
    """
    assert config.out is not None
    path = Path(config.out)
    if path.exists() and not path.is_dir():
        raise UsageError(
            f"--out {config.out} exists and is not a directory: pass a new directory for "
            "the run."
        )
    if resuming or config.overwrite or not path.is_dir():
        return path
    entries = run_entries(path)
    if entries:
        raise OutHoldsRun(config, entries)
    return path


run_entries = outputs.run_entries


def clear_run(out_dir: Path) -> list[str]:
    """Remove the entries of a previous run from ``out_dir`` (``--overwrite``) and return
    their names: only :data:`~torchgpu.train.outputs.files.RUN_ENTRIES`, never another file.
    A link is removed, not what it points to, except a linked directory, whose contents
    are removed (the new run writes through the link again). UsageError naming the
    entry when one cannot be removed."""
    removed = run_entries(out_dir)
    for name in removed:
        path = out_dir / name
        try:
            if path.is_dir() and path.is_symlink():
                for child in path.iterdir():
                    _remove(child)
            else:
                _remove(path)
        except OSError as error:
            raise UsageError(
                f"--overwrite: {path} of the previous run cannot be removed "
                f"({error.strerror or error}); remove it yourself, or pass another --out."
            ) from None
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()


class OutHoldsRun(UsageError):
    """``--out`` holds a run's files and this run neither continues nor overwrites it.

    The message names the entries, the newest checkpoint (if any) and how to continue or
    replace the run: for a :func:`torchgpu.fit` run as keyword arguments, for the
    command line as a generic hint until :meth:`name_command` gives the exact command.
    """

    def __init__(self, config: TrainConfig, entries: Sequence[str]) -> None:
        assert config.out is not None
        self.out = config.out
        self.entries = list(entries)
        self.newest = newest_checkpoint(Path(config.out))
        from torchgpu.train.checkpoints.resume_plan import saved_changes

        self.changed = saved_changes(config, self.newest) if self.newest else []
        self.from_fit = (config.model or "").startswith("fit:")
        super().__init__(self._message(None))

    def name_command(self, argv: Sequence[str]) -> None:
        """Say the exact commands: ``argv`` (``torchgpu train ...``, as typed) with
        ``--resume`` (the saved values of changed settings put back) or ``--overwrite``."""
        self.args = (self._message(list(argv)),)

    def _message(self, argv: list[str] | None) -> str:
        found = ", ".join(f"{name}/" if outputs.RUN_ENTRIES[name] else name
                          for name in self.entries)
        text = (f"--out {self.out} already holds a run ({found}) and this run would write "
                "over it; nothing was written or changed. ")
        resume, overwrite = _ways(argv, self.changed, self.from_fit)
        if self.newest is not None:
            saved = (" with the settings it was saved with ("
                     + ", ".join(f"{key} {was!r}, not {now!r}" for key, was, now in self.changed)
                     + ")" if self.changed else "")
            text += (f"Its newest checkpoint is {self.newest}: to continue the run from "
                     f"there{saved}, {resume}. To start it over instead, {overwrite}")
        else:
            text += f"It holds no checkpoint to continue from. To start it over, {overwrite}"
        return (text + " (this removes the previous run's entries listed above and nothing "
                "else), or pass a new --out.")


def _ways(argv: list[str] | None, changed: list[tuple[str, Any, Any]], from_fit: bool
          ) -> tuple[str, str]:
    """How to continue and how to overwrite: the commands, or fit's keyword arguments."""
    if from_fit:
        settings = "".join(f", {key}={was!r}" for key, was, _ in changed)
        return (f"call fit(...) again with resume=True{settings}",
                "call fit(...) with overwrite=True")
    if argv is None:
        return ("run the same command with --resume"
                + (" and those settings" if changed else ""),
                "run the same command with --overwrite")
    resumed = list(argv)
    for key, was, _ in changed:
        resumed = with_flag(resumed, "--" + key.replace("_", "-"), was)
    return (f"run: {shlex.join([*resumed, '--resume'])}",
            f"run: {shlex.join([*argv, '--overwrite'])}")


def with_flag(argv: Sequence[str], flag: str, value: Any) -> list[str]:
    """``argv`` with ``flag``'s value set to ``value`` where it is given (``FLAG V`` or
    ``FLAG=V``; the last one counts), appended when it is not; ``None`` removes it."""
    out: list[str] = []
    i = 0
    items = list(argv)
    while i < len(items):
        item = items[i]
        if item == flag:
            i += 2
            continue
        if not item.startswith(flag + "="):
            out.append(item)
        i += 1
    return out + ([flag, str(value)] if value is not None else [])


def newest_checkpoint(out_dir: Path) -> Path | None:
    """The newest complete checkpoint of the run in ``out_dir`` (the one ``--resume``
    continues from when ``latest`` is intact), or None; reads only."""
    from torchgpu.checkpoint import list_checkpoints
    from torchgpu.errors import CheckpointError
    from torchgpu.train.checkpoints.resume_plan import checkpoints_dir

    try:
        found = list_checkpoints(checkpoints_dir(out_dir))
    except CheckpointError:
        return None
    return found[-1] if found else None
