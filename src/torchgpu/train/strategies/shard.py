"""This rank's slice of the training order: :class:`Shard`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """This rank's slice of the training order (``make_loader``'s ``dist`` argument).

    Always "distributed", even for one process, so the order of epoch ``e`` is the same
    permutation ``randperm(n, seed + e)`` for every world size: the global batch of a
    DDP run holds exactly the samples of the one-process run with the global batch.
    The shard is unpadded (``make_loader(pad=False)``, :mod:`torchgpu.data.shards`):
    when the training set does not split evenly, ranks hold different numbers of the
    last batch's samples (possibly none), and the loop weights each rank's loss by its
    samples (:mod:`torchgpu.train.loop.tail`), so DDP trains the one-process weights
    (to float rounding) for every dataset size, not only for multiples of the world.
    """

    rank: int
    world_size: int
    is_distributed: bool = True
