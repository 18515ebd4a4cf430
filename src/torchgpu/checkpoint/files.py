"""The boundary where checkpoint paths meet the operating system.

Every file a checkpoint reader opens goes through :func:`open_regular`, and every
``stat`` / directory listing of a user-given path through :func:`kind_of` /
:func:`list_dir`. They turn each ``OSError`` (a symbolic-link loop, a name too long, a
permission denied, an I/O error) into a :class:`~torchgpu.errors.CheckpointFormatError`
naming the path, so no caller sees a traceback, and they never read anything but a
regular file: a FIFO, a socket or a device (``/dev/zero``) given as a checkpoint is
refused before a single byte is read (a FIFO is opened non-blocking, so even the open
cannot hang).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, Literal

from torchgpu.errors import CheckpointFormatError
from torchgpu.user_files import show as show  # files.show: how the checkpoint code names paths

Kind = Literal["missing", "file", "dir", "other"]

_MISSING = (errno.ENOENT, errno.ENOTDIR)


def os_error(path: str | Path, error: OSError, doing: str = "read") -> CheckpointFormatError:
    """The one-paragraph error for ``error`` raised while ``doing`` ``path``."""
    code = error.errno
    if code == errno.ELOOP:
        problem = "is a symbolic link loop (or has too many levels of links)"
        fix = "Point the link at a real checkpoint file or directory"
    elif code == errno.ENAMETOOLONG:
        problem = "has a name too long for the file system"
        fix = "Check the path (a `latest` file must hold one short directory name)"
    elif code in (errno.EACCES, errno.EPERM):
        problem = "cannot be read: permission denied"
        fix = "Give this user read access (chmod u+r, or u+rx for a directory) or run as its owner"
    elif code in _MISSING:
        problem = "does not exist"
        fix = "Check the path"
    else:
        problem = f"could not be {doing} ({error.strerror or error})"
        fix = "Check the file system and the path"
    return CheckpointFormatError(f"{show(path)} {problem}. {fix}.")


def _not_regular(path: str | Path, mode: int) -> CheckpointFormatError:
    what = ("a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else
            "a directory" if stat.S_ISDIR(mode) else "not a regular file")
    return CheckpointFormatError(
        f"{show(path)} is {what}, not a checkpoint file; nothing was read from it. Pass a "
        "checkpoint file (.safetensors .pt .pth .bin .ckpt) or a checkpoint directory.")


def kind_of(path: str | Path) -> Kind:
    """What ``path`` is, following symbolic links: ``missing`` (no such entry, or a
    dangling link), ``file`` (regular), ``dir``, or ``other`` (FIFO, device, socket).
    Any other ``OSError`` (a link loop, a name too long, a permission denied on the way)
    is a :class:`CheckpointFormatError` naming ``path``."""
    try:
        mode = os.stat(path).st_mode
    except OSError as error:
        if error.errno in _MISSING:
            return "missing"
        raise os_error(path, error, "examined") from None
    except ValueError:  # an embedded NUL byte: no such path can exist
        return "missing"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"


def exists(path: str | Path) -> bool:
    """Whether ``path`` names anything (see :func:`kind_of` for the errors)."""
    return kind_of(path) != "missing"


def open_regular(path: str | Path) -> BinaryIO:
    """``path`` opened for binary reading, after checking (on the open descriptor, so a
    swap cannot slip in) that it is a regular file. Raises
    :class:`CheckpointFormatError` naming ``path`` otherwise, or on any ``OSError``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        raise os_error(path, error) from None
    except ValueError:
        raise CheckpointFormatError(f"{show(path)} contains a NUL byte, so it cannot name a "
                                    "file. Check the path.") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except OSError as error:
        os.close(fd)
        raise os_error(path, error) from None
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | Path, limit: int | None = None) -> bytes:
    """The bytes of regular file ``path`` (at most ``limit`` + 1 when given, so a caller
    can tell that the file is larger than it accepts)."""
    with open_regular(path) as handle:
        try:
            return handle.read() if limit is None else handle.read(limit + 1)
        except OSError as error:
            raise os_error(path, error) from None


def check_regular(path: str | Path) -> int:
    """The size in bytes of regular file ``path``; :class:`CheckpointFormatError` naming
    it when it is anything else or cannot be examined. For readers that must pass a path
    (not a handle) to a library."""
    with open_regular(path) as handle:
        return os.fstat(handle.fileno()).st_size


def list_dir(path: str | Path) -> list[Path]:
    """The entries of directory ``path``, or a :class:`CheckpointFormatError` naming it."""
    try:
        return list(Path(path).iterdir())
    except OSError as error:
        raise os_error(path, error, "listed") from None
