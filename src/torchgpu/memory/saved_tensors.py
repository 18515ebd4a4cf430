"""What autograd keeps for backward, measured: :func:`saved_tensor_bytes`.

The exact counterpart, on real tensors, of the activation estimate on fake ones
(:mod:`torchgpu.memory.estimate.activations`); used to measure what activation
checkpointing saves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def saved_tensor_bytes(fn: Callable[[], Any]) -> int:
    """Bytes autograd saves for backward while ``fn()`` runs (run the forward only).

    Counted through ``torch.autograd.graph.saved_tensors_hooks``: each saved tensor's
    whole storage, each unique storage once (a ReLU's saved output that is also the
    next Linear's saved input counts once). Not counted: leaf tensors that require grad
    (parameters, and views of them such as a Linear's transposed weight), whose memory
    exists whether or not autograd keeps them. Under activation checkpointing the
    tensors saved inside a checkpointed segment are not kept (they are recomputed), but
    each segment's inputs are, and are counted.
    """
    sizes: dict[tuple[str, int], int] = {}
    alive: list[Any] = []  # keep storages alive so a freed pointer is not reused and miscounted

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if base.is_leaf and base.requires_grad:
            return tensor
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        key = (str(tensor.device), pointer if pointer else id(storage))
        sizes[key] = storage.nbytes()
        alive.append(storage)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    alive.clear()
    return sum(sizes.values())

