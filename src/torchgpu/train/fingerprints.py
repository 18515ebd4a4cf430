"""The files a run was built from and their sha256 fingerprints.

A run built from a user's files (a ``path/to/file.py:attr`` spec's file, a ``--data`` CSV)
records each file's sha256 by its absolute path in ``OUT/config.toml``, ``summary.json``
and every checkpoint's ``meta.json``: a replay whose files changed warns, naming each, and
a resume is refused unless ``--force-resume``. Built-in examples, module specs and
``torchgpu.fit``'s objects have no file to record. A file is hashed once per process
(streamed in 1 MiB blocks) while its size, modification time and inode stay the same, so
the replay check, the resume check and the run's records share one hash.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

from torchgpu.train.config import TrainConfig
from torchgpu.user_files import reading

_BLOCK = 1 << 20
_SHORT = 12  # hex digits of a fingerprint's short form in messages
# (path, size, mtime_ns, inode) -> sha256 hex: one hash per file per process
_hashed: dict[tuple[str, int, int, int], str] = {}


def spec_file(spec: str | None) -> str | None:
    """The absolute path of the file a ``path/to/file.py:attr`` spec names (None for a
    module spec, a built-in name or ``fit:<name>``)."""
    if spec is None or spec.startswith("fit:"):
        return None
    location, sep, _ = spec.rpartition(":")
    if sep and (location.endswith(".py") or os.sep in location or "/" in location):
        return os.path.abspath(location)
    return None


def run_files(config: TrainConfig) -> list[str]:
    """The user's files ``config`` builds the run from, absolute, each once, in the
    order model, data, loss, optimizer."""
    found = [spec_file(config.model)]
    if config.model is not None and config.target is None:
        found.append(spec_file(config.data))  # a data spec
    elif config.data is not None and not config.data.startswith("fit:"):
        found.append(os.path.abspath(config.data))  # a data file (CSV)
    found += [spec_file(config.loss), spec_file(config.optimizer)]
    return list(dict.fromkeys(path for path in found if path is not None))


def sha256_file(path: str) -> str:
    """The sha256 (hex) of the file at ``path``, streamed; cached while the file's size,
    modification time and inode stay the same. An OSError is a one-paragraph
    UsageError naming the file."""
    fix = "Check the file, or pass another path."
    with reading(path, what="file", fix=fix):
        info = os.stat(path)
        key = (path, info.st_size, info.st_mtime_ns, info.st_ino)
        if key not in _hashed:
            digest = hashlib.sha256()
            with open(path, "rb") as handle:
                for block in iter(lambda: handle.read(_BLOCK), b""):
                    digest.update(block)
            _hashed[key] = digest.hexdigest()
        return _hashed[key]


def fingerprints(config: TrainConfig) -> dict[str, str]:
    """``{absolute path: sha256 hex}`` of the run's files (:func:`run_files`) that exist
    now (one that does not is refused where the run reads it)."""
    return {path: sha256_file(path) for path in run_files(config) if os.path.isfile(path)}


def short(digest: str) -> str:
    """A fingerprint's short form for messages: its first 12 hex digits."""
    return digest[:_SHORT]


@dataclass(frozen=True)
class Changed:
    """A file whose fingerprint differs from the recorded one."""

    path: str
    recorded: str
    current: str

    def words(self) -> str:
        """``/p/model.py (sha256 0123456789ab then, ba9876543210 now)``."""
        return f"{self.path} (sha256 {short(self.recorded)} then, {short(self.current)} now)"


def changed_files(recorded: object, config: TrainConfig) -> list[Changed]:
    """The files of ``config`` whose fingerprint differs from ``recorded`` (a
    ``{path: sha256}`` mapping read back from a file: anything else records nothing).
    Only files that the run uses and that exist now are compared."""
    if not isinstance(recorded, Mapping):
        return []
    changes = []
    for path, digest in fingerprints(config).items():
        then = recorded.get(path)
        if isinstance(then, str) and then != digest:
            changes.append(Changed(path, then, digest))
    return changes
