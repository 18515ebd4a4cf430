"""Checkpoints that survive crashes and load across wrappers.

- :func:`save_checkpoint` / :func:`load_checkpoint`: the training state as an atomic
  directory (model.safetensors, state.pt, meta.json, manifest.json);
- :func:`load_state_dict`: weights from any wrapper (DP, DDP, compile, Lightning, Fabric,
  Accelerate, ``module.`` layouts) into any wrapper, by key matching;
- :func:`find_checkpoint`, :func:`verify_checkpoint`, :func:`inspect_checkpoint`,
  :func:`convert_checkpoint`; :func:`capture_rng_state` / :func:`restore_rng_state`.

Every pickle is read with ``weights_only=True``; ``trust=True`` is the only way around.
"""

from __future__ import annotations

from torchgpu.checkpoint.api import LoadedCheckpoint, load_checkpoint, save_checkpoint
from torchgpu.checkpoint.convert import ConvertResult, convert_checkpoint
from torchgpu.checkpoint.discover import find_checkpoint, list_checkpoints, verify_checkpoint
from torchgpu.checkpoint.inspect import inspect_checkpoint
from torchgpu.checkpoint.keys import KeyMapping, load_state_dict
from torchgpu.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = [
    "ConvertResult",
    "KeyMapping",
    "LoadedCheckpoint",
    "capture_rng_state",
    "convert_checkpoint",
    "find_checkpoint",
    "inspect_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_state_dict",
    "restore_rng_state",
    "save_checkpoint",
    "verify_checkpoint",
]
