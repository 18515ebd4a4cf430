"""The checkpoint directory format (version 1).

A checkpoint is a directory holding:

- ``model.safetensors``: the unwrapped model's state dict under canonical keys (no
  ``module.`` / ``_orig_mod.``). Tensors that share memory (tied weights) are stored
  once under their first name; the other names are recorded in the safetensors
  metadata entry ``torchgpu.aliases`` (JSON ``{alias: stored_name}``) and re-created on
  load. Non-tensor entries (``get_extra_state``) go to ``state.pt``.
- ``state.pt``: ``{"format", "step", "epoch", "optimizer", "scheduler", "scaler",
  "rng", "extra", "model_extra"}`` -- only weights-only-safe values, checked before
  writing by :func:`check_weights_only_safe`.
- ``meta.json``: ``{"format", "format_version", "step", "epoch", "world_size",
  "versions", "created_unix_s", ...meta given by the caller}``.
- ``manifest.json``: ``{"format", "files": {name: {"sha256", "size_bytes"}}}``, written
  last; a directory without it is not a complete checkpoint.

A *sharded* checkpoint (``--strategy fsdp``, :mod:`torchgpu.checkpoint.sharded`) has no
``model.safetensors``: its model and optimizer states are the
``torch.distributed.checkpoint`` files in ``shards/`` (``shards/.metadata`` and each
rank's ``.distcp`` files), listed in the manifest as ``shards/NAME``; the manifest then
says ``"layout": "sharded"``.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import platform
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, NoReturn

import torch

from torchgpu.checkpoint import files
from torchgpu.checkpoint.readers import safetensors_extent
from torchgpu.errors import CheckpointCorruptError, CheckpointError, CheckpointFormatError

FORMAT = "torchgpu-checkpoint"
FORMAT_VERSION = 1
MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
ALIASES_KEY = "torchgpu.aliases"
SHARDS_DIR = "shards"  # a sharded checkpoint's torch.distributed.checkpoint files
SHARDED = "sharded"  # the manifest's and meta.json's "layout" of a sharded checkpoint
SHARDS_METADATA = f"{SHARDS_DIR}/.metadata"
RESERVED_META = ("format", "format_version", "step", "epoch", "versions", "created_unix_s")

_SAFE_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def check_weights_only_safe(value: object, where: str) -> None:
    """Raise :class:`CheckpointError` naming the first entry of ``value`` that
    ``torch.load(weights_only=True)`` could not read back (numpy scalars, functions,
    custom classes...)."""
    if isinstance(value, (*_SAFE_SCALARS, torch.Size)):
        return
    if isinstance(value, torch.Tensor):
        if type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(
                f"{where} is a {type(value).__name__} tensor subclass, which weights-only loading "
                "cannot read back; store a plain tensor (.detach().clone()) instead")
        return
    if isinstance(value, (dict, OrderedDict)):
        for key, item in value.items():
            check_weights_only_safe(key, f"{where} key {key!r}")
            check_weights_only_safe(item, f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple, set)) and type(value) in (list, tuple, set):
        for index, item in enumerate(value):
            check_weights_only_safe(item, f"{where}[{index}]")
        return
    raise CheckpointError(
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a weights-only "
        "checkpoint cannot hold; allowed are tensors, numbers, str, bool, None and "
        "lists/tuples/dicts of them. Convert it (e.g. float(x), x.tolist(), str(path)) "
        "before saving")


def memory_identity(tensor: torch.Tensor) -> tuple[object, ...]:
    """What makes two tensors one (tied) tensor: the same device, storage, offset, shape,
    strides and dtype. Meaningless for meta tensors, which have no storage."""
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)


def split_shared(
    state: Mapping[str, object],
) -> tuple[dict[str, torch.Tensor], dict[str, str], dict[str, object]]:
    """Split a model state dict into ``(tensors, aliases, non_tensors)`` ready for
    safetensors: tensors sharing memory appear once (first name kept, the other names in
    ``aliases``), partly-overlapping views are cloned, all are contiguous CPU tensors."""
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    others: dict[str, object] = {}
    seen: dict[tuple[object, ...], str] = {}
    storages: dict[tuple[str, int], list[str]] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            others[name] = value
            continue
        tensor = value.detach()
        if tensor.device.type == "meta":
            raise CheckpointError(
                f"model entry {name!r} is on the meta device and has no data to save; "
                "materialise the model (to_empty + init or load weights) before saving")
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        identity = memory_identity(tensor)
        if tensor.numel() > 0 and identity in seen:
            aliases[name] = seen[identity]
            continue
        seen[identity] = name
        storages.setdefault((str(tensor.device), tensor.untyped_storage().data_ptr()), []).append(
            name)
        tensors[name] = tensor
    shared = {n for names in storages.values() if len(names) > 1 for n in names}
    for name, tensor in tensors.items():
        complete = tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        if name in shared or not complete or not tensor.is_contiguous():
            tensor = tensor.contiguous().clone()
        tensors[name] = tensor.to("cpu")
    return tensors, aliases, others


def apply_aliases(tensors: dict[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Re-create alias names (tied weights) recorded in safetensors ``metadata``."""
    raw = metadata.get(ALIASES_KEY)
    if not raw:
        return
    try:
        aliases = json.loads(raw)
    except (ValueError, RecursionError):
        aliases = None
    if not isinstance(aliases, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()):
        raise CheckpointFormatError(
            f"the {ALIASES_KEY} metadata of the weights file is not a JSON object of tensor "
            "names; the file is damaged. Use an earlier checkpoint")
    for alias, stored in aliases.items():
        if stored in tensors:
            tensors[alias] = tensors[stored]


def model_bytes(state: Mapping[str, object]) -> tuple[bytes, dict[str, object]]:
    """safetensors bytes for a canonical model state dict, and its non-tensor entries."""
    from safetensors.torch import save

    tensors, aliases, others = split_shared(state)
    metadata = {"format": "pt", ALIASES_KEY: json.dumps(aliases, sort_keys=True)}
    return _sorted_metadata(save(tensors, metadata=metadata)), others


def _sorted_metadata(data: bytes) -> bytes:
    """``data`` with its safetensors ``__metadata__`` entries in sorted order.

    safetensors writes metadata from a hash map whose order changes from process to
    process; sorting makes the same weights give the same bytes (bitwise-reproducible
    runs, stable sha256). The header keeps its length, so offsets stay valid; anything
    unexpected leaves the bytes as they are.
    """
    if len(data) < 8:
        return data
    size = int.from_bytes(data[:8], "little")
    raw = data[8:8 + size]
    try:
        header = json.loads(raw, object_pairs_hook=OrderedDict)
    except ValueError:
        return data
    meta = header.get("__metadata__")
    if not isinstance(meta, dict):
        return data
    header["__metadata__"] = OrderedDict(sorted(meta.items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(text) > size or raw[len(text):].strip(b" "):
        return data
    return data[:8] + text + b" " * (size - len(text)) + data[8 + size:]


def torch_bytes(obj: object) -> bytes:
    """``torch.save`` of ``obj`` into bytes."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _json_default(value: object) -> object:
    if isinstance(value, Path):
        return str(value)
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    raise TypeError(f"{type(value).__qualname__} is not JSON serialisable")


def versions() -> dict[str, str]:
    """Versions worth recording with a checkpoint."""
    found = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("torchgpu", "safetensors", "numpy"):
        try:
            module = __import__(name)
            found[name] = str(getattr(module, "__version__", "unknown"))
        except ImportError:
            continue
    return found


def meta_bytes(meta: Mapping[str, object] | None, *, step: int, epoch: int,
               world_size: int) -> bytes:
    """The ``meta.json`` text: the caller's ``meta`` plus the format's own fields."""
    user = dict(meta or {})
    clash = [key for key in RESERVED_META if key in user]
    if clash:
        raise CheckpointError(
            f"meta= uses reserved key(s) {clash}; those are written by save_checkpoint itself. "
            "Rename them (e.g. put them under 'config')")
    record: dict[str, object] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step, "epoch": epoch,
        "world_size": world_size, "versions": versions(), "created_unix_s": round(time.time(), 3),
    }
    record.update(user)
    try:
        text = json.dumps(record, indent=2, sort_keys=True, default=_json_default,
                          allow_nan=True)
    except (TypeError, ValueError) as error:
        raise CheckpointError(
            f"meta= cannot be written as JSON ({error}); use numbers, strings, lists, dicts, "
            "paths or dataclasses") from None
    return (text + "\n").encode()


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


#: Files the loaders read from a checkpoint directory; its manifest must list each one.
REQUIRED_FILES = (MODEL_FILE, STATE_FILE, META_FILE)
#: The same for a sharded checkpoint (its model and optimizer are in ``shards/``).
REQUIRED_SHARDED_FILES = (STATE_FILE, META_FILE, SHARDS_METADATA)
_MAX_MANIFEST_BYTES = 1 << 20
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
    raw = files.read_bytes(path, limit=_MAX_MANIFEST_BYTES)
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise _bad_manifest(path, f"larger than {_MAX_MANIFEST_BYTES} bytes")
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


def read_meta(directory: Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint directory ({} when absent, unreadable, not a
    regular file or not a JSON object)."""
    try:
        raw = files.read_bytes(directory / META_FILE, limit=_MAX_MANIFEST_BYTES * 16)
        record = json.loads(raw.decode("utf-8"))
    except (CheckpointError, ValueError, RecursionError):
        return {}
    return record if isinstance(record, dict) else {}


def commit_order(directory: Path) -> tuple[float, int, float]:
    """Sort key of a checkpoint directory, oldest commit first: ``created_unix_s`` from
    meta.json, then the directory's mtime (ns; breaks ties within a millisecond), then
    the step. Commit time, not the step, because a run resumed from an earlier step saves
    lower steps after higher ones."""
    meta = read_meta(directory)
    try:
        mtime_ns = directory.stat().st_mtime_ns
    except OSError:
        mtime_ns = 0
    return (_sort_number(meta.get("created_unix_s")), mtime_ns, _sort_number(meta.get("step")))


def _sort_number(value: object) -> float:
    """``value`` as a float sort key; anything that is not a finite number (a string, an
    integer too large for a float, NaN -- which would make the order arbitrary) sorts
    first, as if absent."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return -math.inf
    try:
        number = float(value)
    except OverflowError:
        return -math.inf
    return number if math.isfinite(number) else -math.inf
