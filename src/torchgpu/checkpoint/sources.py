"""Reading the weights out of any supported checkpoint file or directory.

:func:`read_weights` returns the loaded object (a state dict or a dict containing one)
for :mod:`torchgpu.checkpoint.keys` to match. Supported: torchgpu checkpoint
directories (manifest verified, tied-weight aliases re-created), run directories with
``latest``, safetensors files, torch.save files (``.pt .pth .bin .ckpt``, weights-only),
Accelerate ``save_state`` / Hugging Face directories (``model.safetensors``, sharded
``model.safetensors.index.json``, ``pytorch_model.bin``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchgpu.checkpoint import files
from torchgpu.checkpoint.discover import find_checkpoint, locate
from torchgpu.checkpoint.layout import (
    MANIFEST_FILE,
    META_FILE,
    MODEL_FILE,
    STATE_FILE,
    apply_aliases,
)
from torchgpu.checkpoint.manifest import verify_directory
from torchgpu.checkpoint.readers import read_pickle, read_safetensors, sniff
from torchgpu.checkpoint.sharded_load import is_sharded, read_sharded_model
from torchgpu.errors import CheckpointCorruptError, CheckpointFormatError

if TYPE_CHECKING:
    from torch.serialization import MAP_LOCATION

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.bin", "model.pt", "model.pth")
INDEX_FILE = "model.safetensors.index.json"


def read_file(path: Path, *, trust: bool = False, map_location: MAP_LOCATION = "cpu") -> Any:
    """A single checkpoint file: safetensors (aliases applied) or a weights-only pickle."""
    if sniff(path) == "safetensors":
        device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
        tensors, metadata = read_safetensors(path, device=device)
        apply_aliases(tensors, metadata)
        return tensors
    return read_pickle(path, map_location=map_location, trust=trust)


def verify_before_loading(directory: Path) -> dict[str, int]:
    """:func:`~torchgpu.checkpoint.manifest.verify_directory` for a loader: a missing
    manifest is a :class:`CheckpointCorruptError` that also names the opt-out."""
    if not files.exists(directory / MANIFEST_FILE):
        gone = [name for name in (STATE_FILE, META_FILE) if not files.exists(directory / name)]
        also = f" ({' and '.join(gone)} too)" if gone else ""
        raise CheckpointCorruptError(
            f"{files.show(directory / MANIFEST_FILE)} is missing{also}, so the files of "
            f"{files.show(directory)} cannot be verified (the save was interrupted, or the "
            "files were deleted) and nothing was loaded. Use an earlier checkpoint, or, if "
            "you trust these files, load them unverified from Python with verify=False "
            "(load_state_dict / load_checkpoint)")
    return verify_directory(directory)


def read_our_model(directory: Path, *, map_location: MAP_LOCATION = "cpu",
                   verify: bool = True) -> dict[str, object]:
    """The model state dict of a torchgpu checkpoint directory, aliases and non-tensor
    entries included. ``verify`` checks every file against the manifest first; a missing
    manifest is then a :class:`CheckpointCorruptError` saying how to opt out."""
    if verify:
        verify_before_loading(directory)
    if is_sharded(directory):  # the shards of every rank, gathered in this process
        return dict(read_sharded_model(directory))
    state: dict[str, object] = read_file(directory / MODEL_FILE, map_location=map_location)
    if not verify and not files.exists(directory / STATE_FILE):
        return state  # unverified on request, and its state.pt deleted: the weights alone
    extras = read_pickle(directory / STATE_FILE, map_location=map_location)
    if isinstance(extras, dict) and isinstance(extras.get("model_extra"), dict):
        state.update(extras["model_extra"])
    return state


def _read_sharded(directory: Path, map_location: MAP_LOCATION) -> dict[str, object]:
    index_path = directory / INDEX_FILE
    try:
        weight_map = json.loads(files.read_bytes(index_path).decode("utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise CheckpointFormatError(
            f"{index_path} is not a valid safetensors index ({error}); it must hold a "
            "'weight_map' of tensor name -> shard file") from None
    state: dict[str, object] = {}
    for shard in shards:
        if not isinstance(shard, str) or "/" in shard or shard.startswith("."):
            raise CheckpointFormatError(f"{index_path} names shard {shard!r} outside its "
                                        "directory; refusing to read it")
        state.update(read_file(directory / shard, map_location=map_location))
    return state


def read_weights(path: Path, *, trust: bool = False, map_location: MAP_LOCATION = "cpu",
                 verify: bool = True) -> Any:
    """The weights object stored at ``path`` (file or directory, as
    :func:`~torchgpu.checkpoint.discover.locate` classifies it); see the module doc. A
    finished run directory gives its final ``model.safetensors`` (the trained model), a
    run stopped early the checkpoint its ``latest`` names. ``verify=False`` skips the
    manifest check of a torchgpu checkpoint directory."""
    located = locate(path)
    if located.kind == "file":
        return read_file(path, trust=trust, map_location=map_location)
    if located.kind == "missing":
        raise CheckpointFormatError(f"{files.show(path)}: no such file or directory. Check "
                                    "the path")
    if located.kind == "checkpoint":
        return read_our_model(path, map_location=map_location, verify=verify)
    if located.final_model is not None:
        return read_file(located.final_model, trust=trust, map_location=map_location)
    if located.kind == "weights":
        if files.exists(path / INDEX_FILE):
            return _read_sharded(path, map_location)
        for name in WEIGHT_FILES:
            if files.kind_of(path / name) == "file":
                return read_file(path / name, trust=trust, map_location=map_location)
    found = find_checkpoint(path)
    if found is not None:
        return read_our_model(found, map_location=map_location, verify=verify)
    raise CheckpointFormatError(
        f"{files.show(path)} is a directory with no checkpoint in it (looked for "
        f"{MANIFEST_FILE}, a 'latest' file, a checkpoints/ directory, {INDEX_FILE} and "
        f"{', '.join(WEIGHT_FILES)}); pass a checkpoint file or directory")
