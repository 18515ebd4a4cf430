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
from typing import Any

import torch

from torchgpu.checkpoint.discover import find_checkpoint
from torchgpu.checkpoint.layout import (
    MANIFEST_FILE,
    MODEL_FILE,
    STATE_FILE,
    apply_aliases,
    verify_checkpoint,
)
from torchgpu.checkpoint.readers import read_pickle, read_safetensors, sniff
from torchgpu.errors import CheckpointFormatError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.bin", "model.pt", "model.pth")
INDEX_FILE = "model.safetensors.index.json"


def read_file(path: Path, *, trust: bool = False, map_location: Any = "cpu") -> Any:
    """A single checkpoint file: safetensors (aliases applied) or a weights-only pickle."""
    if sniff(path) == "safetensors":
        device = str(map_location) if isinstance(map_location, (str, torch.device)) else "cpu"
        tensors, metadata = read_safetensors(path, device=device)
        apply_aliases(tensors, metadata)
        return tensors
    return read_pickle(path, map_location=map_location, trust=trust)


def read_our_model(directory: Path, *, map_location: Any = "cpu",
                   verify: bool = True) -> dict[str, Any]:
    """The model state dict of a torchgpu checkpoint directory, aliases and non-tensor
    entries included. ``verify`` checks the manifest first."""
    if verify:
        verify_checkpoint(directory)
    state: dict[str, Any] = read_file(directory / MODEL_FILE, map_location=map_location)
    extras = read_pickle(directory / STATE_FILE, map_location=map_location).get("model_extra")
    if isinstance(extras, dict):
        state.update(extras)
    return state


def _read_sharded(directory: Path, map_location: Any) -> dict[str, Any]:
    index_path = directory / INDEX_FILE
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointFormatError(
            f"{index_path} is not a valid safetensors index ({error}); it must hold a "
            "'weight_map' of tensor name -> shard file") from None
    state: dict[str, Any] = {}
    for shard in shards:
        if "/" in shard or shard.startswith("."):
            raise CheckpointFormatError(f"{index_path} names shard {shard!r} outside its "
                                        "directory; refusing to read it")
        state.update(read_file(directory / shard, map_location=map_location))
    return state


def read_weights(path: Path, *, trust: bool = False, map_location: Any = "cpu") -> Any:
    """The weights object stored at ``path`` (file or directory); see the module doc."""
    if path.is_file():
        return read_file(path, trust=trust, map_location=map_location)
    if not path.exists():
        raise CheckpointFormatError(f"{path}: no such file or directory. Check the path")
    if (path / MANIFEST_FILE).exists() and (path / MODEL_FILE).exists():
        return read_our_model(path, map_location=map_location)
    if (path / INDEX_FILE).exists():
        return _read_sharded(path, map_location)
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return read_file(path / name, trust=trust, map_location=map_location)
    found = find_checkpoint(path)
    if found is not None:
        return read_our_model(found, map_location=map_location)
    raise CheckpointFormatError(
        f"{path} is a directory with no checkpoint in it (looked for {MANIFEST_FILE}, a "
        f"'latest' file, {INDEX_FILE} and {', '.join(WEIGHT_FILES)}); pass a checkpoint file "
        "or directory")
