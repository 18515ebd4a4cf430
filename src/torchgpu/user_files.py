"""The boundary where a path the user typed meets the operating system.

Every file torchgpu reads because the user named it (``--data`` table, ``--config``
TOML, a ``file.py:attr`` spec, ``launch``'s script) goes through :func:`check_file` and
is read inside :func:`reading` (or with :func:`read_text`): any ``OSError`` on the way
-- a name longer than the file system allows, a permission denied, an I/O error from
``/proc/self/mem``, a symbolic-link loop -- becomes one paragraph naming the flag, the
path, what is wrong and the fix, as the error class the caller gives (:class:`UsageError`
or :class:`DataError`, exit code 2 on the CLI). Only regular files are read: a
directory, a FIFO or a device is refused before a byte is read.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torchgpu.errors import TorchGpuError, UsageError

_SHOW_CHARS = 160  # longer paths are shortened in messages (a 5000-character name is noise)
_SHOW_HEAD = 100  # characters kept from the start of a shortened path; the rest from its end


def show(path: str | Path) -> str:
    """``path`` for a message: as is, or -- when very long -- its start and its end (the
    file name) around ``...`` with its length; control characters (newline, NUL) are
    escaped so the message stays one paragraph. Every message that names a user's
    path uses it (the checkpoint readers too)."""
    text = str(path)
    if text.isprintable() and len(text) <= _SHOW_CHARS:
        return text
    if len(text) <= _SHOW_CHARS:
        return repr(text)[1:-1]
    head, tail = text[:_SHOW_HEAD], text[-(_SHOW_CHARS - _SHOW_HEAD):]
    return f"{repr(head)[1:-1]}...{repr(tail)[1:-1]} ({len(text)} characters)"


def _name_max(path: Path) -> int:
    """The longest name the file system of ``path``'s nearest existing ancestor allows."""
    for ancestor in (path, *path.parents):
        try:
            return int(os.pathconf(ancestor, "PC_NAME_MAX"))
        except (OSError, ValueError):
            continue
    return 255


def problem(path: str | Path, error: OSError, doing: str = "read") -> str:
    """What ``error`` (raised while ``doing`` ``path``) says about the path, as the end of a
    sentence that starts with the path: ``"does not exist"``."""
    code = error.errno
    if code == errno.ENOENT:
        return "does not exist"
    if code == errno.ENOTDIR:
        return "does not exist (a part of it is a file, not a directory)"
    if code == errno.ENAMETOOLONG:
        absolute = Path(os.path.abspath(path))
        limit = _name_max(absolute.parent)
        longest = max(absolute.parts, key=lambda part: len(part.encode(errors="replace")))
        size = len(longest.encode(errors="replace"))
        if size > limit:
            return (f"cannot exist: a name in it is {size} characters long and this file "
                    f"system allows at most {limit} per name")
        return "cannot exist: the path is longer than this file system allows"
    if code in (errno.EACCES, errno.EPERM):
        return f"cannot be {doing}: permission denied"
    if code == errno.ELOOP:
        return "is a symbolic link loop (or has too many levels of links)"
    if code == errno.EISDIR:
        return "is a directory, not a file"
    return f"could not be {doing} ({error.strerror or error})"


def _kind(mode: int) -> str:
    return ("a directory" if stat.S_ISDIR(mode) else
            "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else
            "a character device" if stat.S_ISCHR(mode) else
            "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")


def check_file(path: str | Path, *, what: str, fix: str,
               error: type[TorchGpuError] = UsageError, probe: bool = False) -> Path:
    """``path`` as a Path when it names a regular file (links followed), else ``error``
    with ``f"{what} {path} <problem>. {fix}"`` (``what``: how the user gave it, e.g.
    ``"--config"`` or ``"data file"``; ``fix``: what to pass instead). ``probe``: also
    read its first byte, for a file that another process will read (a file that
    fails to read, such as /proc/self/mem, is refused here)."""
    if not str(path) or "\0" in str(path):
        raise error(f"{what} {show(path)!r} is not a path. {fix}")
    try:
        mode = os.stat(path).st_mode
    except OSError as failure:
        raise error(f"{what} {show(path)} {problem(path, failure, 'examined')}. {fix}") \
            from None
    if not stat.S_ISREG(mode):
        raise error(f"{what} {show(path)} is {_kind(mode)}, not a file; nothing was read "
                    f"from it. {fix}")
    if probe:
        with reading(path, what=what, fix=fix, error=error), open(path, "rb") as file:
            file.read(1)
    return Path(path)


@contextmanager
def reading(path: str | Path, *, what: str, fix: str,
            error: type[TorchGpuError] = UsageError) -> Iterator[None]:
    """Inside the block, an ``OSError`` (while the file at ``path`` is opened and read)
    becomes ``error`` naming ``what`` and ``path``."""
    try:
        yield
    except OSError as failure:
        raise error(f"{what} {show(path)} {problem(path, failure)}. {fix}") from None


def read_text(path: str | Path, *, what: str, fix: str,
              error: type[TorchGpuError] = UsageError, encoding: str = "utf-8") -> str:
    """The text of the regular file at ``path`` (:func:`check_file`, :func:`reading`); a
    file that is not ``encoding`` text is ``error`` too."""
    file = check_file(path, what=what, fix=fix, error=error)
    with reading(path, what=what, fix=fix, error=error):
        try:
            return file.read_text(encoding=encoding)
        except UnicodeDecodeError as failure:
            raise error(f"{what} {show(path)} is not {encoding.upper()} text "
                        f"({failure.reason} at byte {failure.start}). {fix}") from None
