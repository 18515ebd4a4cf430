"""What a checkpoint holds, without trusting it.

:func:`inspect_checkpoint` never runs the full unpickler: safetensors headers are parsed
directly, pickles with globals outside torch's weights-only allowlist are only
disassembled (their keys are then unknown and ``unsafe_globals`` lists what they would
import), and safe pickles are read weights-only with memory-mapped data.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

import torch

from torchgpu.checkpoint import atomic, files
from torchgpu.checkpoint.discover import (
    LATEST,
    Located,
    find_checkpoint,
    is_checkpoint_dir,
    locate,
)
from torchgpu.checkpoint.files import show
from torchgpu.checkpoint.keys import candidate_states
from torchgpu.checkpoint.layout import ALIASES_KEY, MANIFEST_FILE, MODEL_FILE, read_meta
from torchgpu.checkpoint.manifest import is_complete, read_manifest
from torchgpu.checkpoint.readers import read_pickle, safetensors_header, sniff, unsafe_globals
from torchgpu.checkpoint.sources import INDEX_FILE, WEIGHT_FILES
from torchgpu.errors import CheckpointError, CheckpointFormatError

#: Leading key components that wrappers add, and who adds them.
WRAPPERS = {
    "module": "nn.DataParallel / DistributedDataParallel / FSDP(1) (or a 'module.' layout)",
    "_orig_mod": "torch.compile",
}

_ST_DTYPES = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1),
    "U8": ("uint8", 1), "U16": ("uint16", 2), "U32": ("uint32", 4), "U64": ("uint64", 8),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
}


class TensorRow(TypedDict):
    """One tensor in :func:`inspect_checkpoint`'s ``tensors`` list."""

    key: str
    shape: list[int]
    dtype: str
    bytes: int


def _tensor_rows_from_header(header: Mapping[str, Any]) -> list[TensorRow]:
    rows: list[TensorRow] = []
    for key, info in header.items():
        dtype, _ = _ST_DTYPES.get(str(info.get("dtype")), (str(info.get("dtype")).lower(), 0))
        start, end = info["data_offsets"]
        rows.append({"key": key, "shape": list(info.get("shape", [])), "dtype": dtype,
                     "bytes": int(end) - int(start)})
    return rows


def _tensor_rows(state: Mapping[str, object]) -> list[TensorRow]:
    rows: list[TensorRow] = []
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            rows.append({"key": key, "shape": list(value.shape),
                         "dtype": str(value.dtype).removeprefix("torch."),
                         "bytes": value.numel() * value.element_size()})
    return rows


def wrapper_prefixes(keys: list[str]) -> list[str]:
    """Leading wrapper components (``module.``, ``_orig_mod.``) shared by all ``keys``."""
    found: list[str] = []
    depth = 0
    while keys:
        parts = {tuple(k.split("."))[depth] if k.count(".") > depth else None for k in keys}
        if len(parts) != 1:
            break
        part = parts.pop()
        if part not in WRAPPERS:
            break
        found.append(f"{part}.")
        depth += 1
    return found


def common_prefix(keys: list[str]) -> str:
    """The longest leading run of key components shared by all ``keys`` ("" if none)."""
    if not keys:
        return ""
    split = [k.split(".")[:-1] for k in keys]
    shared: list[str] = []
    for parts in zip(*split, strict=False):
        if len(set(parts)) != 1:
            break
        shared.append(parts[0])
    return "".join(f"{p}." for p in shared)


def _summarise(rows: list[TensorRow]) -> dict[str, object]:
    keys = [r["key"] for r in rows]
    strip = "".join(wrapper_prefixes(keys))
    groups: dict[str, dict[str, int]] = {}
    for row in rows:
        top = row["key"][len(strip):].split(".")[0]
        group = groups.setdefault(top, {"num_tensors": 0, "bytes": 0})
        group["num_tensors"] += 1
        group["bytes"] += row["bytes"]
    dtypes = Counter(r["dtype"] for r in rows)
    return {
        "num_tensors": len(rows), "total_bytes": sum(r["bytes"] for r in rows),
        "dtypes": dict(sorted(dtypes.items())), "groups": groups,
        "wrapper_prefixes": wrapper_prefixes(keys),
        "compiled_submodules": sum("._orig_mod." in f".{k}" for k in keys),
        "common_prefix": common_prefix(keys), "tensors": rows,
    }


def _inspect_file(path: Path) -> dict[str, object]:
    kind = sniff(path)
    info: dict[str, object] = {"path": str(path), "format": kind, "size_bytes": path.stat().st_size}
    if kind == "safetensors":
        header, metadata = safetensors_header(path)
        info["metadata"] = {k: v for k, v in metadata.items() if k != ALIASES_KEY}
        try:
            aliases = json.loads(metadata.get(ALIASES_KEY) or "{}")
        except ValueError:
            aliases = {"<unreadable>": str(metadata.get(ALIASES_KEY))}
        if aliases:
            info["aliases"] = aliases
        info.update(_summarise(_tensor_rows_from_header(header)))
        return info
    bad = unsafe_globals(path)
    info["unsafe_globals"] = bad
    if bad:
        info["note"] = ("the pickle needs globals outside the weights-only allowlist; keys are "
                        "not listed because reading them would execute code")
        return info
    obj = read_pickle(path, mmap=True)
    candidates = candidate_states(obj)
    if not candidates:
        info["note"] = "no state dict (mapping of tensors) found in the file"
        info["top_level_keys"] = sorted(map(str, obj))[:20] if isinstance(obj, Mapping) else []
        info.update(_summarise([]))
        return info
    container, state = max(candidates, key=lambda c: len(c[1]))
    info["container"] = container
    if isinstance(obj, Mapping):
        info["top_level_keys"] = sorted(str(k) for k in obj)[:20]
        for key in ("epoch", "global_step", "step"):
            if isinstance(obj.get(key), int):
                info[key] = obj[key]
    info.update(_summarise(_tensor_rows(state)))
    return info


def _designated(located: Located) -> Path | None:
    """The checkpoint directory a located path names: itself, else the one ``latest``
    names when it exists (complete or not: inspecting shows what is wrong with it), else
    the newest complete one (:func:`find_checkpoint`, which warns about the fallback)."""
    if located.kind == "checkpoint":
        return located.path
    if located.parent is None:
        return None
    name = atomic.read_pointer(located.parent, LATEST)
    if name is not None and is_checkpoint_dir(located.parent / name):
        return located.parent / name
    return find_checkpoint(located.path)


def _inspect_sharded(directory: Path) -> dict[str, object]:
    """A sharded checkpoint's model tensors, from its shard metadata alone."""
    from torchgpu.checkpoint.sharded_load import model_tensors

    rows: list[TensorRow] = [
        {"key": key, "shape": shape, "dtype": str(dtype).removeprefix("torch."),
         "bytes": math.prod(shape) * dtype.itemsize}
        for key, shape, dtype in model_tensors(directory)]
    return {"layout": "sharded", **_summarise(rows)}


def _inspect_dir(directory: Path) -> dict[str, object]:
    from torchgpu.checkpoint.sharded_load import is_sharded

    try:
        info = (_inspect_sharded(directory) if is_sharded(directory)
                else _inspect_file(directory / MODEL_FILE))
    except CheckpointFormatError as error:  # a damaged checkpoint: say why, list no keys
        info = {"note": str(error)}
    meta = read_meta(directory)
    try:
        files = {n: int(i.get("size_bytes", 0)) for n, i in read_manifest(directory).items()}
    except CheckpointError:
        files = {}
    info.update({"path": str(directory), "format": "torchgpu-dir",
                 "complete": is_complete(directory), "step": meta.get("step"),
                 "epoch": meta.get("epoch"), "meta": meta, "files": files,
                 "size_bytes": sum(files.values())})
    return info


def inspect_checkpoint(path: str | Path) -> dict[str, object]:
    """A JSON-ready description of the checkpoint at ``path`` (file or directory).

    Keys: ``path``, ``format`` (``torchgpu-dir``, ``safetensors``, ``torch-zip``,
    ``pickle``, ``hf-sharded``), ``num_tensors``, ``total_bytes``, ``dtypes``, ``groups``
    (per top-level module, after wrapper prefixes), ``wrapper_prefixes``,
    ``common_prefix``, ``tensors`` (key, shape, dtype, bytes); for torchgpu directories
    also ``step``, ``epoch``, ``meta``, ``files`` and ``complete``; for pickles
    ``unsafe_globals`` (found statically) and ``container``. A directory of checkpoints,
    or a run directory stopped before it finished, is inspected at the checkpoint its
    ``latest`` names, even an incomplete one (``complete: False``, and a ``note`` when its
    weights are unreadable); a finished run directory at its final ``model.safetensors``
    (what :func:`~torchgpu.checkpoint.load_state_dict` loads from it), with a ``note``
    naming its checkpoints. Paths are resolved by
    :func:`~torchgpu.checkpoint.discover.locate`.
    """
    source = Path(path)
    located = locate(source)
    if located.kind == "missing":
        raise CheckpointFormatError(f"{show(source)}: no such file or directory. Check the path")
    if located.kind == "file":
        return _inspect_file(source)
    if located.final_model is not None:  # a finished run: its result, not a checkpoint
        info = _inspect_file(located.final_model)
        info["note"] = (f"the final model of the run in {source}; its checkpoints (training "
                        f"state, what --resume loads) are in {located.parent}")
        return info
    directory = _designated(located)
    if directory is not None:
        return _inspect_dir(directory)
    if files.exists(source / INDEX_FILE):
        rows: list[TensorRow] = []
        for shard in sorted(source.glob("*.safetensors")):
            rows += _tensor_rows_from_header(safetensors_header(shard)[0])
        return {"path": str(source), "format": "hf-sharded", **_summarise(rows)}
    for name in WEIGHT_FILES:
        if files.kind_of(source / name) == "file":
            return _inspect_file(source / name)
    raise CheckpointFormatError(
        f"{show(source)} is a directory with no checkpoint in it (looked for {MANIFEST_FILE}, "
        f"a 'latest' file, a checkpoints/ directory, {INDEX_FILE} and "
        f"{', '.join(WEIGHT_FILES)}); pass a checkpoint file or directory")
