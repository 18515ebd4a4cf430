"""Crash-safe directory commits.

Contract of :func:`commit_directory`: the files are written into a hidden temporary
sibling ``.NAME.tmp-HOST-PID-RAND``, each fsynced, the temporary directory fsynced, then
``os.rename``d onto the final name and the parent directory fsynced. A reader therefore
sees either no directory or a complete one; a crash (SIGKILL, power loss, ENOSPC) leaves
at most an orphan temporary, which :func:`clean_orphans` removes once its writer is dead.

Overwriting an existing ``NAME`` takes two renames: ``NAME`` -> ``.NAME.old-HOST-PID-RAND``,
then the temporary -> ``NAME``. An error between them renames the old directory back
before raising; a crash between them leaves the old directory only under its ``.old-``
name, and :func:`clean_orphans` renames it back to ``NAME`` (it deletes an ``.old-``
directory only when ``NAME`` exists, i.e. the replacement was committed). So the old
checkpoint is never lost, whatever stops the overwrite.
:func:`write_pointer` updates the ``latest`` file the same way (temporary file, fsync,
``os.replace``), and is called only after the commit.

Fault-injection hook (tests only): every byte goes through the module attribute
``_write`` (``os.write`` by default). Tests replace it to stall a writer before a
SIGKILL or to raise ``OSError(errno.ENOSPC)``; production code never changes it. Renames
call ``os.rename`` at call time, so tests patch that to fail or kill between the renames.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path

from torchgpu.checkpoint import files
from torchgpu.errors import CheckpointError, CheckpointFormatError, CheckpointWriteError

_write: Callable[[int, memoryview], int] = os.write

_CHUNK_BYTES = 64 << 20
_ORPHAN = re.compile(
    r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def token() -> str:
    """The unique part of a temporary's name: host, process id, random hex."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Create ``path`` (must not exist), write ``data`` fully and fsync it. Its mode is
    what ``open()`` would give a new file (0o666 less the umask), like every other file a
    run writes."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        view = memoryview(data).cast("B")
        while view:
            written = _write(fd, view[:_CHUNK_BYTES])
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def make_parent(parent: Path) -> None:
    """Create directory ``parent`` (and its parents) if needed; a file or other non-directory
    in the way is a :class:`CheckpointError` naming it."""
    for ancestor in (parent, *parent.parents):
        kind = files.kind_of(ancestor)
        if kind == "dir":
            break
        if kind != "missing":
            raise CheckpointError(
                f"cannot save a checkpoint in {files.show(parent)}: {files.show(ancestor)} is "
                "a file, not a directory. Choose another directory, or move that file away")
    parent.mkdir(parents=True, exist_ok=True)


def write_error(path: Path, error: OSError) -> CheckpointWriteError:
    """The one-paragraph error for ``error`` raised while writing ``path`` atomically."""
    from torchgpu.user_files import problem

    if error.errno == errno.ENOSPC:
        reason, fix = "the disk is full", "free space or choose another directory"
    else:
        reason = f"it {problem(path, error, 'written')}"
        fix = ("move what is in the way, or choose another directory"
               if error.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.ENOTDIR)
               else "fix the permissions or choose another directory")
    return CheckpointWriteError(
        f"could not write {files.show(path)}: {reason}. Nothing was committed and any earlier "
        f"copy of it is untouched; {fix}, and run again")


def commit_directory(final: Path, files: dict[str, bytes | bytearray | memoryview]) -> Path:
    """Write ``files`` (name -> bytes, in order) as directory ``final``, atomically.

    If ``final`` already exists it is replaced: it is moved aside, the new one renamed
    in, and the old one deleted. On any error the temporary is removed, a moved-aside
    old ``final`` is renamed back, and a :class:`CheckpointError` is raised (an
    ``OSError`` such as ENOSPC included); ``final`` then holds what it held before.
    """
    parent = final.parent
    temp = parent / f".{final.name}.tmp-{token()}"
    aside: Path | None = None
    renamed_in = False
    try:
        make_parent(parent)
        temp.mkdir()
        for name, data in files.items():
            write_file(temp / name, data)
        fsync_dir(temp)
        if final.exists():
            aside = parent / f".{final.name}.old-{token()}"
            os.rename(final, aside)
        os.rename(temp, final)
        renamed_in = True
        fsync_dir(parent)
    except OSError as error:
        _undo(temp, aside, final, renamed_in)
        raise write_error(final, error) from None
    except BaseException:
        _undo(temp, aside, final, renamed_in)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def _undo(temp: Path, aside: Path | None, final: Path, renamed_in: bool) -> None:
    """A failed commit: drop the new directory (``renamed_in``: already at ``final``,
    e.g. the parent's fsync failed) and put a moved-aside old ``final`` back."""
    if renamed_in:
        with contextlib.suppress(OSError):
            os.rename(final, temp)
    shutil.rmtree(temp, ignore_errors=True)
    if aside is not None and aside.exists() and not final.exists():
        with contextlib.suppress(OSError):  # if this fails too, clean_orphans retries it
            os.rename(aside, final)


def write_file_atomic(final: Path, data: bytes | bytearray | memoryview) -> Path:
    """Replace file ``final`` with ``data`` atomically (temporary sibling, fsync, rename)."""
    try:
        _replace(final, data)
    except OSError as error:
        raise write_error(final, error) from None
    return final


def _replace(final: Path, data: bytes | bytearray | memoryview) -> None:
    """:func:`write_file_atomic` raising the ``OSError`` as is (the temporary removed)."""
    temp = final.parent / f".{final.name}.tmp-{token()}"
    try:
        make_parent(final.parent)
        write_file(temp, data)
        os.replace(temp, final)
        fsync_dir(final.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


def write_pointer(parent: Path, target_name: str, pointer: str = "latest") -> None:
    """Point ``parent/pointer`` at ``target_name`` (one line of text), atomically. On
    failure (disk full...) the pointer keeps naming what it named, and the
    :class:`CheckpointError` says so."""
    path = parent / pointer
    try:
        _replace(path, (target_name + "\n").encode())
    except OSError as error:
        reason = "the disk is full" if error.errno == errno.ENOSPC else str(error)
        raise CheckpointWriteError(
            f"could not update {files.show(path)} to name {files.show(target_name)!r} "
            f"({reason}); it still names what it named before") from None


#: The longest name ``latest`` may hold (NAME_MAX on Linux and macOS).
MAX_POINTER_NAME = 255


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot be a checkpoint directory named by ``latest`` (``None`` when it
    can): it must be one plain entry (not empty, ``.`` or ``..``, no ``/`` or ``\\``), hold
    no control characters (``latest`` is one line of text), no leading or trailing
    whitespace (which the line loses), be valid UTF-8 (what ``latest`` is written in)
    and at most :data:`MAX_POINTER_NAME` bytes encoded."""
    if name in ("", ".", ".."):
        return f"{name!r} is not a directory name"
    if "/" in name or "\\" in name:
        return "it contains a path separator"
    if any(unicodedata.category(char) == "Cc" for char in name):
        return "it contains a control character (a newline, a tab, NUL...)"
    if name != name.strip():
        return "it starts or ends with whitespace"
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        return "it is not valid UTF-8 (bytes the file system gave back undecoded)"
    if len(encoded) > MAX_POINTER_NAME:
        return f"it is {len(encoded)} bytes long (at most {MAX_POINTER_NAME})"
    return None


def read_pointer(parent: Path, pointer: str = "latest") -> str | None:
    """The directory name ``parent/pointer`` holds, or ``None`` when the file is absent or
    empty.

    The name must be one plain entry of ``parent`` that :func:`name_problem` accepts
    (what :func:`~torchgpu.checkpoint.save_checkpoint` accepts as a name). Anything else
    -- or a pointer that is not a readable regular file (a directory, a FIFO, a link
    loop, no permission) -- is a :class:`CheckpointFormatError` naming the file, never a
    path outside ``parent`` and never a blocking read.
    """
    path = parent / pointer
    if files.kind_of(path) == "missing":
        return None
    raw = files.read_bytes(path, limit=4 * MAX_POINTER_NAME)
    try:
        text: str | None = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        text = None
    if text == "":
        return None
    problem = ("it is not UTF-8 text" if text is None else
               f"it is longer than {4 * MAX_POINTER_NAME} bytes"
               if len(raw) > 4 * MAX_POINTER_NAME else name_problem(text))
    if problem is not None:
        shown = files.show(raw[:80].decode("utf-8", "replace"))
        raise CheckpointFormatError(
            f"{files.show(path)} does not hold a checkpoint directory name: it holds "
            f"{shown!r} ({len(raw)}{'+' if len(raw) > 4 * MAX_POINTER_NAME else ''} bytes) and "
            f"{problem}; it must be one name of at most {MAX_POINTER_NAME} bytes inside "
            f"{files.show(parent)}, without '/', control characters or '..'. Write the name "
            f"of a checkpoint there (e.g. `echo step-00000100 > {files.show(path)}`) or "
            "delete it to use the newest complete checkpoint")
    return text


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own earlier attempt; it failed or we would not be here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def iter_orphans(parent: Path) -> Iterator[Path]:
    """Temporaries in ``parent`` left by writers on this host that are no longer running
    (``.NAME.tmp-*`` and ``.NAME.old-*``)."""
    if files.kind_of(parent) != "dir":
        return
    host = socket.gethostname()
    for entry in files.list_dir(parent):
        match = _ORPHAN.match(entry.name)
        if match and match["host"] == host and not _pid_alive(int(match["pid"])):
            yield entry


def _restore(entry: Path) -> bool:
    """Rename an orphan ``.NAME.old-*`` directory back to ``NAME`` when ``NAME`` is free:
    its writer died between the two renames of an overwrite, so it is the only copy of
    the committed ``NAME``. Returns whether it was restored."""
    match = _ORPHAN.match(entry.name)
    if match is None or match["kind"] != "old" or not entry.is_dir():
        return False
    final = entry.parent / match["name"]
    if final.exists():
        return False
    try:
        os.rename(entry, final)
    except OSError:  # another process restored it first, or it cannot be moved: keep it
        return True
    with contextlib.suppress(OSError):
        fsync_dir(entry.parent)
    return True


def restore_moved_aside(final: Path) -> bool:
    """If ``final`` is missing because its writer died between the two renames of an
    overwrite, rename the moved-aside copy back; returns whether ``final`` now exists."""
    if files.exists(final) or files.kind_of(final.parent) != "dir":
        return files.exists(final)
    for entry in iter_orphans(final.parent):
        match = _ORPHAN.match(entry.name)
        if match is not None and match["name"] == final.name:
            _restore(entry)
    return final.exists()


def clean_orphans(parent: Path) -> list[Path]:
    """Delete orphan temporaries in ``parent`` and put back a moved-aside old checkpoint
    whose replacement never landed (see the module docstring); returns what was removed."""
    removed = []
    for entry in list(iter_orphans(parent)):
        if _restore(entry):
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                entry.unlink()
        removed.append(entry)
    return removed


def is_temporary(name: str) -> bool:
    """Whether ``name`` is one of our temporaries (never a checkpoint to load)."""
    return _ORPHAN.match(name) is not None
