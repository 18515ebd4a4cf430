"""Tied weights: one tensor of a model under several names, any one of which may be saved.

A model that ties weights (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
lists the tensor under every name in its state dict, while savers that keep each tensor
once (Hugging Face ``save_pretrained`` to safetensors, which drops ``lm_head.weight``)
store one name only. Loading any one name of a tie group fills them all, so the other
names are not missing; :func:`tied_elsewhere` says which missing keys are covered that
way. A checkpoint holding several names of one group is loaded name after name, as
``torch.nn.Module.load_state_dict`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from torchgpu.checkpoint.layout import memory_identity


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
