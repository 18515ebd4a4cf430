"""Unpadded shards: each sample of an epoch on exactly one rank, once.

``DistributedSampler`` makes the ranks equally long by repeating samples when the
dataset does not split evenly, so a DDP run trains on a few samples twice and its
weights differ from a one-process run. :class:`ShardBatches` does not pad: rank ``r``
gets positions ``r, r + W, r + 2W, ...`` of the epoch's order (the same seeded
permutation ``DistributedSampler`` draws: ``randperm(n)`` from seed ``seed + epoch``),
cut into batches of ``batch_size``. Every rank yields the same number of batches (DDP
needs one backward per rank per step), so a rank's last batch may be short, or empty
(zero samples) when the epoch's last global batch holds fewer samples than there are
ranks. Local batch ``b`` of all ranks together is global batch ``b`` of one process
with batch ``W * batch_size``: the same samples.

:class:`ShardLayout` is the arithmetic: how many samples batch ``b`` holds on each rank
and over all ranks, so the training loop can weight each rank's loss by its share (see
:meth:`torchgpu.accumulate.GradAccumulator.set_steps`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler, default_collate


@dataclass(frozen=True)
class ShardLayout:
    """``samples`` samples per epoch on ``world_size`` ranks in batches of ``batch_size``.

    Batch ``b`` over all ranks holds global positions ``[b*G, (b+1)*G)`` of the epoch's
    order, ``G = world_size * batch_size`` (fewer in the last batch).
    """

    samples: int
    world_size: int
    batch_size: int

    @property
    def global_batch(self) -> int:
        return self.world_size * self.batch_size

    @property
    def batches(self) -> int:
        """Batches per epoch on every rank (= one process's with the global batch)."""
        return -(-self.samples // self.global_batch)

    @property
    def first_short(self) -> int:
        """The first batch index whose global batch is short; ``batches`` if none is."""
        full, rest = divmod(self.samples, self.global_batch)
        return full if rest else self.batches

    def rank_samples(self, rank: int) -> int:
        """Samples rank ``rank`` holds per epoch."""
        return max(0, -(-(self.samples - rank) // self.world_size))

    def batch_samples(self, index: int, rank: int) -> int:
        """Samples in batch ``index`` on rank ``rank`` (0 for an empty batch)."""
        left = self.rank_samples(rank) - index * self.batch_size
        return min(self.batch_size, max(0, left))

    def global_samples(self, first: int, count: int = 1) -> int:
        """Samples in batches ``first .. first + count - 1`` over all ranks."""
        g = self.global_batch
        return max(0, min(self.samples, (first + count) * g) - first * g)

    def window_share(self, first: int, count: int) -> float | None:
        """A window of ``count`` batches from ``first``: its samples over all ranks
        divided by the world size (what ``GradAccumulator.set_steps`` takes), or None
        when every batch in it is full on every rank (equal weights are exact)."""
        if first + count <= self.first_short:
            return None
        return self.global_samples(first, count) / self.world_size

    def loss_weight(self, index: int, samples: int) -> float:
        """The factor that turns a rank's mean loss over ``samples`` samples of batch
        ``index`` into its part of the global batch's mean loss, such that the mean of
        the factored losses over ranks is the global batch's mean loss."""
        total = self.global_samples(index)
        return samples * self.world_size / total if total else 0.0


class ShardBatches(Sampler[list[int]]):
    """Rank ``rank``'s batches of dataset indices for one epoch, without padding.

    Use as a DataLoader's ``batch_sampler`` with :class:`EmptyBatchCollate` (a batch
    can be empty). Call :meth:`set_epoch` at each epoch's start, as with
    ``DistributedSampler``; ``shuffle=False`` keeps the dataset's order.
    """

    def __init__(self, samples: int, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, seed: int = 0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range for world size {world_size}")
        self.layout = ShardLayout(samples, world_size, batch_size)
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.layout.batches

    def __iter__(self) -> Iterator[list[int]]:
        n = self.layout.samples
        if self.shuffle:  # the permutation DistributedSampler draws for (seed, epoch)
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        mine = order[self.rank::self.layout.world_size]
        size = self.layout.batch_size
        for index in range(self.layout.batches):
            yield mine[index * size:(index + 1) * size]


class EmptyBatchCollate:
    """``collate`` (default ``default_collate``), and for an empty batch the same
    structure with zero rows (shaped like one collated sample of ``dataset``), so an
    empty batch flows through a model like any other."""

    def __init__(self, dataset: Dataset[Any],
                 collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.dataset = dataset
        self.collate = collate or default_collate

    def __call__(self, batch: list[Any]) -> object:
        if batch:
            return self.collate(batch)
        return _zero_rows(self.collate([self.dataset[0]]))


def _zero_rows(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value[:0]
    if isinstance(value, Mapping):
        return {k: _zero_rows(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_zero_rows(v) for v in value]
    return value
