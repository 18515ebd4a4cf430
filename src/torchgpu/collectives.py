"""The collectives the library runs outside a model's wrapper, each the identity without a
process group: every rank takes the same decision (:func:`agree_any`, :func:`agree_min`,
:func:`agree_max`), rank ``src``'s object on every rank or every rank's on each
(:func:`broadcast_object`, :func:`gather_objects`), and this process's rank. Every
function but :func:`current_rank` and :func:`rank_zero_print` is a collective: every rank
calls it, in the same order."""

from __future__ import annotations

import os
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def _group_active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def current_rank() -> int:
    """This process's global rank: from the group if formed, else ``RANK`` (default 0)."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def rank_zero_print(*args: object, **kwargs: Any) -> None:
    """``print`` on global rank 0 only; other ranks stay silent."""
    if current_rank() == 0:
        print(*args, **kwargs)


def _comm_device() -> torch.device:
    # NCCL only reduces CUDA tensors; every other backend here takes CPU tensors.
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_int(value: int, op: dist.ReduceOp.RedOpType) -> int:
    tensor = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(tensor, op=op)
    return int(tensor.item())


def agree_any(flag: bool) -> bool:
    """True on every rank if ``flag`` is True on any rank (identity when not distributed).

    A collective: every rank must call it, in the same order.
    """
    if not _group_active():
        return bool(flag)
    return _all_reduce_int(int(bool(flag)), dist.ReduceOp.MAX) > 0


def agree_min(value: int) -> int:
    """The smallest ``value`` over all ranks (identity when not distributed). Collective."""
    if not _group_active():
        return int(value)
    return _all_reduce_int(int(value), dist.ReduceOp.MIN)


def agree_max(value: int) -> int:
    """The largest ``value`` over all ranks (identity when not distributed). Collective."""
    if not _group_active():
        return int(value)
    return _all_reduce_int(int(value), dist.ReduceOp.MAX)


def broadcast_object(obj: T, src: int = 0) -> T:
    """Rank ``src``'s ``obj`` on every rank (picklable objects; identity when not
    distributed). Collective."""
    if not _group_active():
        return obj
    box: list[T] = [obj]  # rank src's obj on every rank after the broadcast
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_objects(obj: T) -> list[T]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` when not
    distributed). Collective."""
    if not _group_active():
        return [obj]
    out: list[T] = [obj] * dist.get_world_size()  # every slot is filled by its rank
    dist.all_gather_object(out, obj)
    return out
