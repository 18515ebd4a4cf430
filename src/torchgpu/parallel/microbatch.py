"""Scatter a mini-batch into micro-batches and gather them back (dim 0).

A batch is a tensor or a tuple/list of tensors sharing their first dimension.
Non-tensor items of a tuple are handed unchanged to every micro-batch.

``scatter(batch, chunks)`` makes ``min(chunks, batch_size)`` micro-batches with
``torch.tensor_split`` sizes: as equal as possible, the first ones one row larger
when the batch does not divide (10 rows in 4 chunks -> 3, 3, 2, 2). A batch smaller
than ``chunks`` gives one row per micro-batch, never an empty one.
``gather(chunks)`` concatenates along dim 0 and restores the original structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeAlias

import torch

from torchgpu.errors import ConfigError

Batch: TypeAlias = torch.Tensor | tuple[Any, ...] | list[Any]


def batch_size(batch: Batch) -> int:
    """The size of dim 0 shared by the tensors of ``batch``.

    Raises ConfigError when ``batch`` holds no tensor, a 0-d tensor, or tensors whose
    first dimensions differ.
    """
    tensors = (
        [batch]
        if isinstance(batch, torch.Tensor)
        else [t for t in batch if isinstance(t, torch.Tensor)]
    )
    if not tensors:
        raise ConfigError(
            f"a pipeline batch must be a tensor or a tuple holding tensors, got "
            f"{type(batch).__name__}: "
            "pass the input as a tensor (or a tuple of tensors split along dim 0)"
        )
    sizes = []
    for t in tensors:
        if t.dim() == 0:
            raise ConfigError(
                "a pipeline batch tensor is 0-dimensional and cannot be split into micro-batches: "
                "give every input a batch dimension first (dim 0)"
            )
        sizes.append(int(t.shape[0]))
    if len(set(sizes)) != 1:
        raise ConfigError(
            f"the tensors of a pipeline batch have different batch sizes {sizes} along dim 0: "
            "every tensor in the input tuple must have the same first dimension"
        )
    return sizes[0]


def chunk_sizes(total: int, chunks: int) -> list[int]:
    """The micro-batch sizes ``scatter`` makes for ``total`` rows and ``chunks`` chunks."""
    if chunks < 1:
        raise ConfigError(f"chunks must be a positive integer, got {chunks}: use 1 or more")
    n = min(chunks, total) if total > 0 else 1
    q, r = divmod(total, n)
    return [q + 1 if i < r else q for i in range(n)]


def scatter(batch: Batch, chunks: int) -> list[Batch]:
    """Split ``batch`` along dim 0 into ``min(chunks, batch size)`` micro-batches.

    Each micro-batch has the structure of ``batch`` (tensor, or tuple/list of the same
    length). Tensors are views of the input (no copy).
    """
    sizes = chunk_sizes(batch_size(batch), chunks)
    if isinstance(batch, torch.Tensor):
        return list(torch.split(batch, sizes, dim=0))
    columns = [
        torch.split(item, sizes, dim=0) if isinstance(item, torch.Tensor) else [item] * len(sizes)
        for item in batch
    ]
    kind = type(batch)
    return [kind(col[i] for col in columns) for i in range(len(sizes))]


def gather(outputs: Sequence[Batch]) -> Batch:
    """Concatenate micro-batch outputs along dim 0 (the inverse of ``scatter``).

    Tuples are gathered item by item; a non-tensor item is taken from the first chunk.
    """
    if not outputs:
        raise ConfigError("gather needs at least one micro-batch output, got none")
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([o for o in outputs if isinstance(o, torch.Tensor)], dim=0)
    items = []
    for i, item in enumerate(first):
        if isinstance(item, torch.Tensor):
            items.append(torch.cat([o[i] for o in outputs], dim=0))
        else:
            items.append(item)
    return type(first)(items)
