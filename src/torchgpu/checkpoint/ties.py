"""Tied weights: one tensor of a model under several names, any one of which may be saved.

A model that ties weights (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
lists the tensor under every name in its state dict, while savers that keep each tensor
once (Hugging Face ``save_pretrained`` to safetensors, which drops ``lm_head.weight``)
store one name only. Loading any one name of a tie group fills them all, so the other
names are not missing; :func:`tied_elsewhere` says which missing keys are covered that
way. A checkpoint holding several names of one group with different values (saved from a
model where they were not tied) cannot be loaded into one tensor:
:func:`refuse_tie_conflicts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from torchgpu.checkpoint.layout import memory_identity
from torchgpu.errors import CheckpointError

_SHOW = 5


def tie_groups(target: Mapping[str, object]) -> list[tuple[str, ...]]:
    """The groups of two or more keys of ``target`` (a model's ``state_dict()``) that are
    one tensor (:func:`~torchgpu.checkpoint.layout.memory_identity`). Meta and empty
    tensors are never tied: they have no memory to share."""
    groups: dict[tuple[object, ...], list[str]] = {}
    for key, value in target.items():
        if (not isinstance(value, torch.Tensor) or value.device.type == "meta"
                or value.numel() == 0 or value.layout != torch.strided):
            continue
        groups.setdefault(memory_identity(value), []).append(key)
    return [tuple(keys) for keys in groups.values() if len(keys) > 1]


def tied_elsewhere(missing: Iterable[str], loaded: Iterable[str],
                   groups: list[tuple[str, ...]]) -> set[str]:
    """The ``missing`` keys whose tie group has a ``loaded`` key: loading that one fills
    them too."""
    done = set(loaded)
    covered = {key for group in groups if done.intersection(group) for key in group}
    return covered.intersection(missing)


def refuse_tie_conflicts(source: Mapping[str, object], pairs: Mapping[str, str],
                         groups: list[tuple[str, ...]], origin: str) -> None:
    """Raise :class:`CheckpointError` when source keys loaded (``pairs``: source key ->
    target key) into one tie group hold different values: only the last would survive
    the load, silently. ``origin`` names the checkpoint in the message."""
    group_of = {key: index for index, group in enumerate(groups) for key in group}
    first: dict[int, str] = {}
    conflicts: list[str] = []
    for key, real in pairs.items():
        index = group_of.get(real)
        value = source[key]
        if index is None or not isinstance(value, torch.Tensor):
            continue
        seen = first.setdefault(index, key)
        other = source[seen]
        if seen != key and isinstance(other, torch.Tensor) and not _same(other, value):
            conflicts.append(f"{seen} and {key}")
    if conflicts:
        shown = ", ".join(conflicts[:_SHOW]) + (
            f" and {len(conflicts) - _SHOW} more" if len(conflicts) > _SHOW else "")
        raise CheckpointError(
            f"the weights in {origin} hold different values for {shown}, which are one "
            "(tied) tensor in the model, so only one could be kept; nothing was loaded. "
            "Load them into a model built without tied weights, or pass strict=False to "
            "keep the last of each")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b.to(a.device, a.dtype))
