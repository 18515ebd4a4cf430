"""Rewriting a checkpoint as a plain or DataParallel-layout weights file.

``to="plain"`` gives canonical keys: wrapper prefixes shared by every key
(``module.``, ``_orig_mod.``, in any nesting) are removed, ``_orig_mod`` components
inside keys are dropped, and for a Lightning checkpoint the LightningModule attribute
shared by every key (``model.``) is removed too. ``to="dp"`` then adds ``module.`` --
the layout the seeds' ``_Single2Parallel`` produces and ``nn.DataParallel`` loads.
The output is written atomically (temporary file, fsync, rename). A ``.pt`` output keeps
the source's ``_metadata`` (module versions), re-keyed like the keys, so torch's
version-aware loading still upgrades old layouts; safetensors has no place for it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from torchgpu.checkpoint import atomic, files
from torchgpu.checkpoint.discover import find_checkpoint, locate
from torchgpu.checkpoint.files import show
from torchgpu.checkpoint.inspect import common_prefix, wrapper_prefixes
from torchgpu.checkpoint.keys import (
    candidate_states,
    metadata_of,
    normalize,
    remap_metadata,
    with_metadata,
)
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


def _pick_state(obj: object) -> tuple[str, dict[str, object]]:
    candidates = candidate_states(obj)
    if not candidates:
        raise CheckpointFormatError(
            "the source holds no state dict (no mapping of names to tensors at the top level or "
            "under keys such as 'state_dict' or 'model'); nothing to convert")
    return max(candidates, key=lambda c: len(c[1]))


def canonical_keys(obj: object) -> tuple[dict[str, object], str, str]:
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
    saved = metadata_of(state)
    metadata = remap_metadata(saved, stripped, "") if saved is not None else None
    return (with_metadata(dict(zip(keys, state.values(), strict=True)), metadata), stripped,
            container)


def _infer_fmt(dst: Path) -> str:
    return "pt" if dst.suffix in (".pt", ".pth", ".bin", ".ckpt") else "safetensors"


def _real(path: Path) -> Path:
    try:
        return Path(os.path.realpath(path))
    except (OSError, ValueError):
        return Path(os.path.abspath(path))


def _read_paths(source: Path) -> list[Path]:
    """``source`` and what reading it actually opens (the checkpoint ``latest`` names,
    which may be a link to elsewhere; a run's final model), all with links resolved."""
    located = locate(source)
    found = [source]
    if located.final_model is not None:
        found.append(located.final_model)
    elif located.parent is not None:
        with warnings.catch_warnings():  # the fallback note comes once, from the read
            warnings.simplefilter("ignore")
            designated = find_checkpoint(source)
        if designated is not None:
            found.append(designated)
    return [_real(path) for path in found]


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a.is_relative_to(b) or b.is_relative_to(a)


def _check_destination(source: Path, target: Path, overwrite: bool) -> None:
    """Refuse a destination that cannot be written safely: a missing directory (a typo
    must not create directories), an existing one without ``overwrite``, a directory or
    device, and anything that -- links followed -- is, lies inside or contains the
    source, which ``--force`` would otherwise overwrite (e.g. ``CKPT/model.safetensors``,
    the very checkpoint ``latest`` names)."""
    if files.kind_of(target.parent) != "dir":
        raise CheckpointError(
            f"the directory of {show(target)} ({show(target.parent)}) does not exist; create it "
            f"first (mkdir -p {show(target.parent)}) or choose another destination")
    kind = files.kind_of(target)
    if kind in ("dir", "other"):
        raise CheckpointError(
            f"{show(target)} is {'a directory' if kind == 'dir' else 'not a regular file'}; "
            "name the file to write (e.g. DIR/model.safetensors)")
    real_target = _real(target)
    for real_source in _read_paths(source):
        if _overlap(real_target, real_source):
            where = ("is the source" if real_target == real_source else
                     "lies inside the source" if real_target.is_relative_to(real_source)
                     else "contains the source")
            raise CheckpointError(
                f"the destination {show(target)} {where} {show(source)} (resolved: "
                f"{show(real_target)} and {show(real_source)}); converting would overwrite "
                "the checkpoint being read, even with --force. Write to a path outside it")
    if kind == "file" and not overwrite:
        raise CheckpointError(f"{show(target)} already exists; choose another destination or "
                              "delete it first (or pass --force)")


def convert_checkpoint(
    src: str | Path, dst: str | Path, to: Literal["plain", "dp"] = "plain",
    fmt: Literal["safetensors", "pt"] | None = None, *, trust: bool = False,
    overwrite: bool = False,
) -> ConvertResult:
    """Write the weights of ``src`` (any format :func:`load_state_dict` reads) to ``dst``
    with canonical keys (``to="plain"``) or ``module.``-prefixed keys (``to="dp"``), as
    safetensors or a weights-only-loadable ``torch.save`` file (``fmt``, default from
    the suffix of ``dst``). Tied weights are written as separate copies so any reader
    gets every key. Refuses to overwrite ``dst`` unless ``overwrite``, a ``dst`` whose
    directory does not exist (a typo must not create directories), and -- always -- a
    ``dst`` that is, lies inside or contains ``src`` (links followed)."""
    source, target = Path(src), Path(dst)
    if to not in ("plain", "dp"):
        raise CheckpointError(f"to={to!r} is not a layout; use 'plain' or 'dp'")
    chosen = fmt or _infer_fmt(target)
    if chosen not in ("safetensors", "pt"):
        raise CheckpointError(f"format {chosen!r} is not supported; use 'safetensors' or 'pt'")
    _check_destination(source, target, overwrite)
    state, stripped, container = canonical_keys(read_weights(source, trust=trust))
    added = "module." if to == "dp" else ""
    saved = metadata_of(state)  # module versions, kept for torch's version-aware loading
    metadata = remap_metadata(saved, "", added) if saved is not None else None
    state = with_metadata({added + k: v for k, v in state.items()}, metadata)
    if chosen == "pt":
        plain = {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                 for k, v in state.items()}
        data = torch_bytes(with_metadata(plain, metadata))
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
