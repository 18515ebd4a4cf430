"""Checks that torch's eager kernels make and some releases' fake/meta kernels do not.

The planner, the memory estimator and the placement check run a model's forward on fake
(or meta) tensors: only shapes and dtypes. Whether a wrong input is refused there then
depends on torch's meta kernels, which differ between releases. ``nn.Embedding`` given
float "token ids" (an image batch handed to a language model, ``--input-shape 4,12``
without ``:int64``) fails in torch 2.13 on fake tensors as on real ones, but passes in
torch 2.11 and fails later, far from the cause, or not at all (then a plan is printed
for a forward that cannot run). :class:`IndexDtypeCheck` makes the check itself, with
the eager kernel's message, so every supported torch refuses the same inputs in the same
place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

INDEX_DTYPES = (torch.int64, torch.int32)

# func -> (position of the indices among its arguments, keyword name, op name)
_INDEXED: dict[Callable[..., Any], tuple[int, str, str]] = {
    F.embedding: (0, "input", "embedding"),
    F.embedding_bag: (0, "input", "embedding_bag"),
    torch.embedding: (1, "indices", "embedding"),
    torch.embedding_bag: (1, "indices", "embedding_bag"),
}


def check_indices(func: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> None:
    """RuntimeError, worded as torch's eager kernel words it, when ``func`` is an
    embedding lookup whose indices are not int64/int32 tensors."""
    where = _INDEXED.get(func)
    if where is None:
        return
    position, keyword, op = where
    indices = args[position] if len(args) > position else kwargs.get(keyword)
    if isinstance(indices, torch.Tensor) and indices.dtype not in INDEX_DTYPES:
        raise RuntimeError(
            "Expected tensor for argument #1 'indices' to have one of the following scalar "
            f"types: Long, Int; but got {indices.dtype} instead (while checking arguments "
            f"for {op})"
        )


class IndexDtypeCheck(TorchFunctionMode):
    """While active, embedding lookups with float (or other non-integer) indices raise
    as they do on real tensors (see the module docstring)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        check_indices(func, args, kwargs)
        return func(*args, **kwargs)
