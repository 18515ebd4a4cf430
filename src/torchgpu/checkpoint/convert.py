"""Rewriting a checkpoint as a plain or DataParallel-layout weights file.

``to="plain"`` gives canonical keys: wrapper prefixes shared by every key
(``module.``, ``_orig_mod.``, in any nesting) are removed, ``_orig_mod`` components
inside keys are dropped, and for a Lightning checkpoint the LightningModule attribute
shared by every key (``model.``) is removed too. ``to="dp"`` then adds ``module.`` --
the layout the seeds' ``_Single2Parallel`` produces and ``nn.DataParallel`` loads.
The output is written atomically (temporary file, fsync, rename).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from torchgpu.checkpoint import atomic
from torchgpu.checkpoint.inspect import common_prefix, wrapper_prefixes
from torchgpu.checkpoint.keys import candidate_states, normalize
from torchgpu.checkpoint.layout import split_shared, torch_bytes
from torchgpu.checkpoint.sources import read_weights
from torchgpu.errors import CheckpointError, CheckpointFormatError

_LIGHTNING_MARKERS = ("pytorch-lightning_version", "lightning_version", "lightning")


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_checkpoint` wrote: the file, its format and layout, the
    number of entries, and the prefix it removed / added."""

    path: Path
    fmt: str
    to: str
    num_entries: int
    stripped: str
    added: str
    container: str


def _pick_state(obj: Any) -> tuple[str, dict[str, Any]]:
    candidates = candidate_states(obj)
    if not candidates:
        raise CheckpointFormatError(
            "the source holds no state dict (no mapping of names to tensors at the top level or "
            "under keys such as 'state_dict' or 'model'); nothing to convert")
    return max(candidates, key=lambda c: len(c[1]))


def canonical_keys(obj: Any) -> tuple[dict[str, Any], str, str]:
    """``(state, stripped prefix, container)``: the state dict inside ``obj`` with wrapper
    (and, for Lightning, attribute) prefixes removed."""
    container, state = _pick_state(obj)
    keys = [normalize(k) for k in state]
    stripped = "".join(p for p in wrapper_prefixes(keys) if p != "_orig_mod.")
    keys = [k[len(stripped):] for k in keys]
    lightning = (isinstance(obj, Mapping) and container == "state_dict"
                 and any(marker in obj for marker in _LIGHTNING_MARKERS))
    if lightning:
        shared = common_prefix(keys).split(".")[0]
        if shared:
            keys = [k[len(shared) + 1:] for k in keys]
            stripped += f"{shared}."
    if len(set(keys)) != len(keys):
        raise CheckpointError(
            "removing the wrapper prefixes would give two entries the same name; the source "
            "mixes wrapped and unwrapped keys. Load it with load_state_dict into your model and "
            "save that instead")
    return dict(zip(keys, state.values(), strict=True)), stripped, container


def _infer_fmt(dst: Path) -> str:
    return "pt" if dst.suffix in (".pt", ".pth", ".bin", ".ckpt") else "safetensors"


def convert_checkpoint(
    src: str | Path, dst: str | Path, to: Literal["plain", "dp"] = "plain",
    fmt: Literal["safetensors", "pt"] | None = None, *, trust: bool = False,
    overwrite: bool = False,
) -> ConvertResult:
    """Write the weights of ``src`` (any format :func:`load_state_dict` reads) to ``dst``
    with canonical keys (``to="plain"``) or ``module.``-prefixed keys (``to="dp"``), as
    safetensors or a weights-only-loadable ``torch.save`` file (``fmt``, default from
    the suffix of ``dst``). Tied weights are written as separate copies so any reader
    gets every key. Refuses to overwrite ``dst`` unless ``overwrite``, and a ``dst``
    whose directory does not exist (a typo must not create directories)."""
    source, target = Path(src), Path(dst)
    if to not in ("plain", "dp"):
        raise CheckpointError(f"to={to!r} is not a layout; use 'plain' or 'dp'")
    chosen = fmt or _infer_fmt(target)
    if chosen not in ("safetensors", "pt"):
        raise CheckpointError(f"format {chosen!r} is not supported; use 'safetensors' or 'pt'")
    if not target.parent.is_dir():
        raise CheckpointError(
            f"the directory of {target} ({target.parent}) does not exist; create it first "
            f"(mkdir -p {target.parent}) or choose another destination")
    if target.exists() and not overwrite:
        raise CheckpointError(f"{target} already exists; choose another destination or delete "
                              "it first")
    if target.exists() and source.resolve() == target.resolve():
        raise CheckpointError(f"source and destination are the same file ({target}); write to "
                              "a new path")
    state, stripped, container = canonical_keys(read_weights(source, trust=trust))
    added = "module." if to == "dp" else ""
    state = {added + k: v for k, v in state.items()}
    if chosen == "pt":
        plain = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                 for k, v in state.items()}
        data = torch_bytes(plain)
    else:
        from safetensors.torch import save

        tensors, aliases, others = split_shared(state)
        if others:
            raise CheckpointError(
                f"entries {sorted(others)[:5]} are not tensors and cannot go into safetensors; "
                "convert with --format pt")
        for alias, stored in aliases.items():
            tensors[alias] = tensors[stored].clone()
        data = save(tensors, metadata={"format": "pt"})
    atomic.write_file_atomic(target, data)
    return ConvertResult(path=target, fmt=chosen, to=to, num_entries=len(state),
                         stripped=stripped, added=added, container=container)
