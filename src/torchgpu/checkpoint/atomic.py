"""Crash-safe directory commits.

Contract of :func:`commit_directory`: the files are written into a hidden temporary
sibling ``.NAME.tmp-HOST-PID-RAND``, each fsynced, the temporary directory fsynced, then
``os.rename``d onto the final name and the parent directory fsynced. A reader therefore
sees either no directory or a complete one; a crash (SIGKILL, power loss, ENOSPC) leaves
at most an orphan temporary, which :func:`clean_orphans` removes once its writer is dead.
:func:`write_pointer` updates the ``latest`` file the same way (temporary file, fsync,
``os.replace``), and is called only after the commit.

Fault-injection hook (tests only): every byte goes through the module attribute
``_write`` (``os.write`` by default). Tests replace it to stall a writer before a
SIGKILL or to raise ``OSError(errno.ENOSPC)``; production code never changes it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

from torchgpu.errors import CheckpointError

_write: Callable[[int, memoryview], int] = os.write

_CHUNK_BYTES = 64 << 20
_ORPHAN = re.compile(r"^\.(?P<name>.+)\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{8}$")


def _token() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"


def fsync_dir(path: Path) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes | bytearray | memoryview) -> None:
    """Create ``path`` (must not exist), write ``data`` fully and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data).cast("B")
        while view:
            written = _write(fd, view[:_CHUNK_BYTES])
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_error(path: Path, error: OSError) -> CheckpointError:
    reason = "the disk is full" if error.errno == errno.ENOSPC else str(error)
    return CheckpointError(
        f"could not write checkpoint {path}: {reason}. Nothing was committed and any earlier "
        "checkpoint is untouched; free space or choose another directory and save again")


def commit_directory(final: Path, files: dict[str, bytes | bytearray | memoryview]) -> Path:
    """Write ``files`` (name -> bytes, in order) as directory ``final``, atomically.

    If ``final`` already exists it is replaced: it is moved aside, the new one renamed
    in, and the old one deleted. On any error the temporary is removed and a
    :class:`CheckpointError` is raised (an ``OSError`` such as ENOSPC included).
    """
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    temp = parent / f".{final.name}.tmp-{_token()}"
    try:
        temp.mkdir()
        for name, data in files.items():
            write_file(temp / name, data)
        fsync_dir(temp)
        aside = None
        if final.exists():
            aside = parent / f".{final.name}.old-{_token()}"
            os.rename(final, aside)
        os.rename(temp, final)
        fsync_dir(parent)
    except OSError as error:
        shutil.rmtree(temp, ignore_errors=True)
        raise _disk_error(final, error) from None
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return final


def write_file_atomic(final: Path, data: bytes | bytearray | memoryview) -> Path:
    """Replace file ``final`` with ``data`` atomically (temporary sibling, fsync, rename)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    temp = final.parent / f".{final.name}.tmp-{_token()}"
    try:
        write_file(temp, data)
        os.replace(temp, final)
        fsync_dir(final.parent)
    except OSError as error:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise _disk_error(final, error) from None
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    return final


def write_pointer(parent: Path, target_name: str, pointer: str = "latest") -> None:
    """Point ``parent/pointer`` at ``target_name`` (one line of text), atomically."""
    write_file_atomic(parent / pointer, (target_name + "\n").encode())


def read_pointer(parent: Path, pointer: str = "latest") -> str | None:
    """The name ``parent/pointer`` holds, or ``None`` when absent or unreadable."""
    try:
        text = (parent / pointer).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text or "/" in text or text in (".", ".."):
        return None
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
    """Temporaries in ``parent`` left by writers on this host that are no longer running."""
    if not parent.is_dir():
        return
    host = socket.gethostname()
    for entry in parent.iterdir():
        match = _ORPHAN.match(entry.name)
        if match and match["host"] == host and not _pid_alive(int(match["pid"])):
            yield entry


def clean_orphans(parent: Path) -> list[Path]:
    """Delete orphan temporaries in ``parent``; returns what was removed."""
    removed = []
    for entry in list(iter_orphans(parent)):
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
