"""A checkpoint's ``manifest.json``: each file's sha256 and size, written last. Reading
it validates every entry (a malformed or partial manifest is
:class:`~torchgpu.errors.CheckpointCorruptError`); :func:`verify_directory` checks the
files against it and :func:`is_complete` says whether a directory is a whole checkpoint."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

from torchgpu.checkpoint import files
from torchgpu.checkpoint.layout import (
    FORMAT,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MODEL_FILE,
    REQUIRED_FILES,
    REQUIRED_SHARDED_FILES,
    SHARDED,
    SHARDS_DIR,
)
from torchgpu.checkpoint.readers import safetensors_extent
from torchgpu.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError


def sha256_of(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def manifest_bytes(files: Mapping[str, bytes | bytearray | memoryview],
                   hashed: Mapping[str, Mapping[str, object]] | None = None) -> bytes:
    """``manifest.json`` for ``files`` (name -> content) and the entries of files already
    hashed where they were written (``hashed``: a sharded checkpoint's shards, which
    makes it a ``"layout": "sharded"`` manifest)."""
    entries: dict[str, Mapping[str, object]] = {
        name: {"sha256": sha256_of(data), "size_bytes": len(memoryview(data).cast("B"))}
        for name, data in files.items()}
    record: dict[str, object] = {"format": FORMAT, "files": entries}
    if hashed is not None:
        entries.update(hashed)
        record["layout"] = SHARDED
    return (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()


_HEX = frozenset("0123456789abcdef")


class _DuplicateKeyError(ValueError):
    pass


def _unique_object(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object that names each key once: with a key twice, which entry a reader
    takes is up to the reader, so a manifest holding one verifies nothing for certain."""
    record: dict[str, object] = {}
    for key, value in pairs:
        if key in record:
            raise _DuplicateKeyError(f"the key {key!r} appears twice in one object")
        record[key] = value
    return record


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number")


def _bad_manifest(path: Path, problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{files.show(path)} is malformed ({problem}), so the checkpoint cannot be verified. "
        "Use an earlier checkpoint, or save this one again")


def _plain_name(name: object, sharded: bool) -> bool:
    """Whether manifest entry ``name`` is a file of the checkpoint directory itself or,
    in a sharded checkpoint, one of ``shards/`` (whose ``.metadata`` starts with a dot)."""
    if not isinstance(name, str) or not name or not name.isprintable() or "\\" in name:
        return False
    head, _, leaf = name.partition("/")
    if sharded and head == SHARDS_DIR and leaf:
        return "/" not in leaf and leaf not in (".", "..")
    return "/" not in name and not name.startswith(".") and name != MANIFEST_FILE


def _check_entry(path: Path, name: object, info: object, sharded: bool = False) -> None:
    if not _plain_name(name, sharded):
        raise _bad_manifest(path, f"file name {files.show(repr(name))} is not a plain name "
                                  "inside the checkpoint directory")
    if not isinstance(info, dict):
        raise _bad_manifest(path, f"the entry of {name!r} is a {type(info).__name__}, not an "
                                  "object with 'sha256' and 'size_bytes'")
    digest, size = info.get("sha256"), info.get("size_bytes")
    if not (isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX):
        raise _bad_manifest(path, f"the sha256 of {name!r} is not 64 lowercase hex digits")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _bad_manifest(path, f"the size_bytes of {name!r} is not a non-negative integer")


def read_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """The ``files`` table of ``directory/manifest.json``, validated: a JSON object with
    ``"format"`` and ``"files"``, each entry a plain file name mapped to
    ``{"sha256": 64 hex digits, "size_bytes": int}``, and every file the loaders read
    (:data:`REQUIRED_FILES`) listed -- an empty or partial table would let altered files
    through unverified.

    Raises :class:`CheckpointCorruptError` naming the manifest when it is missing or
    malformed in any way, :class:`CheckpointFormatError` when it cannot be read
    (permissions, not a regular file).
    """
    path = directory / MANIFEST_FILE
    kind = files.kind_of(path)
    if kind == "missing":
        raise CheckpointCorruptError(
            f"{files.show(path)} is missing, so {files.show(directory)} is not a complete "
            "checkpoint (the save was interrupted before it committed, or the manifest was "
            "deleted) and its files cannot be verified; use an earlier checkpoint")
    if kind == "dir":
        raise _bad_manifest(path, "a directory, not a file")
    raw = files.read_bytes(path, limit=MAX_MANIFEST_BYTES)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise _bad_manifest(path, f"larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        record = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_object,
                            parse_constant=_no_constant)
    except _DuplicateKeyError as error:
        raise _bad_manifest(path, str(error)) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise _bad_manifest(path, f"not JSON: {error}") from None
    if not isinstance(record, dict):
        raise _bad_manifest(path, f"a JSON {type(record).__name__}, not an object")
    if record.get("format") != FORMAT:
        raise _bad_manifest(path, f"'format' is {record.get('format')!r}, not {FORMAT!r}")
    table = record.get("files")
    if not isinstance(table, dict):
        raise _bad_manifest(path, "'files' is missing or not an object" if table is None
                            else f"'files' is a {type(table).__name__}, not an object")
    sharded = record.get("layout") == SHARDED
    for name, info in table.items():
        _check_entry(path, name, info, sharded)
    required = REQUIRED_SHARDED_FILES if sharded else REQUIRED_FILES
    unlisted = [name for name in required if name not in table]
    if unlisted:
        raise _bad_manifest(path, f"it does not list {', '.join(unlisted)}, which the loader "
                                  "reads")
    return table


def is_complete(directory: Path) -> bool:
    """Cheap completeness check: a valid manifest whose files all exist with their sizes."""
    try:
        table = read_manifest(directory)
        return all((directory / name).stat().st_size == info["size_bytes"]
                   for name, info in table.items())
    except (CheckpointError, OSError):
        return False


def _sha256(file: Path) -> tuple[int, str]:
    """(size, sha256) of regular file ``file``, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    size = 0
    with files.open_regular(file) as handle:
        try:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
                size += len(block)
        except OSError as error:
            raise files.os_error(file, error) from None
    return size, digest.hexdigest()


def verify_directory(directory: Path) -> dict[str, int]:
    """:func:`~torchgpu.checkpoint.discover.verify_checkpoint` of checkpoint directory
    ``directory`` itself. Every listed file's size is checked against the manifest, and
    ``model.safetensors``'s against its own header, before any file is hashed: a
    truncated or grown file is refused after reading a few KiB, not all of it."""
    table = read_manifest(directory)
    for name, info in sorted(table.items()):
        _check_size(directory / name, info["size_bytes"])
    checked: dict[str, int] = {}
    for name, info in sorted(table.items()):
        file = directory / name
        size, digest = _sha256(file)
        if size != info["size_bytes"]:  # changed since its size was checked
            raise _wrong_size(file, size, info["size_bytes"])
        if digest != info["sha256"]:
            raise CheckpointCorruptError(
                f"{file} does not match its sha256 in the manifest (the bytes were altered); use "
                "an earlier checkpoint")
        checked[name] = size
    return checked


def _check_size(file: Path, expected: int) -> None:
    """Refuse ``file`` (listed in the manifest with ``expected`` bytes) when it is
    missing, not a file, of another size, or a safetensors file whose header accounts
    for another size -- all without reading its data."""
    kind = files.kind_of(file)
    if kind == "missing":
        raise CheckpointCorruptError(
            f"{files.show(file)} is listed in the manifest but missing; the checkpoint is "
            "damaged. Use an earlier checkpoint")
    if kind == "dir":
        raise CheckpointCorruptError(
            f"{files.show(file)} is a directory, but the manifest lists a file of "
            f"{expected} bytes there; the checkpoint is damaged. Use an earlier checkpoint")
    size = files.check_regular(file)
    if size != expected:
        raise _wrong_size(file, size, expected)
    if file.name != MODEL_FILE:
        return
    try:
        described, size = safetensors_extent(file)
    except CheckpointFormatError as error:  # listed in a manifest: damaged, not foreign
        raise CheckpointCorruptError(str(error)) from None
    if described != size:
        raise CheckpointCorruptError(
            f"{file} is {size} bytes but its safetensors header describes {described} "
            f"({'truncated' if size < described else 'altered: bytes after the last tensor'}"
            "); use an earlier checkpoint")


def _wrong_size(file: Path, size: int, expected: int) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{file} is {size} bytes but the manifest records {expected} "
        f"({'truncated' if size < expected else 'altered'}); use an earlier checkpoint")
