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
  last; a directory without it is not a complete checkpoint (:mod:`.manifest` writes,
  reads and verifies it).

A *sharded* checkpoint (``--strategy fsdp``, :mod:`torchgpu.checkpoint.sharded`) has no
``model.safetensors``: its model and optimizer states are the
``torch.distributed.checkpoint`` files in ``shards/`` (``shards/.metadata`` and each
rank's ``.distcp`` files), listed in the manifest as ``shards/NAME``; the manifest then
says ``"layout": "sharded"``.
"""

from __future__ import annotations

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
from typing import Any

import torch

from torchgpu.checkpoint import files
from torchgpu.errors import CheckpointError, CheckpointFormatError

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


#: Files the loaders read from a checkpoint directory; its manifest must list each one.
REQUIRED_FILES = (MODEL_FILE, STATE_FILE, META_FILE)
#: The same for a sharded checkpoint (its model and optimizer are in ``shards/``).
REQUIRED_SHARDED_FILES = (STATE_FILE, META_FILE, SHARDS_METADATA)
#: The largest manifest read (meta.json: 16 times this).
MAX_MANIFEST_BYTES = 1 << 20


def read_meta(directory: Path) -> dict[str, Any]:
    """``meta.json`` of a checkpoint directory ({} when absent, unreadable, not a
    regular file or not a JSON object)."""
    try:
        raw = files.read_bytes(directory / META_FILE, limit=MAX_MANIFEST_BYTES * 16)
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
