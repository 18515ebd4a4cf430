"""make_loader: one DataLoader recipe for one process, DDP ranks, CPU and CUDA.

Under DDP each rank gets a :class:`~torch.utils.data.distributed.DistributedSampler`
shard (or, with ``pad=False``, an unpadded :class:`~torchgpu.data.shards.ShardBatches`
shard). The caller must call :func:`set_epoch` at the start of every epoch, or every
epoch repeats the first epoch's order.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sized
from typing import Any, TypeGuard

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torch.utils.data.distributed import DistributedSampler

from torchgpu.data.batches import DictPairs
from torchgpu.data.collate import Collate
from torchgpu.data.workers import worker_choice
from torchgpu.distributed import RankInfo
from torchgpu.errors import DataError


def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    dist: RankInfo | None = None,
    device: torch.device | str | None = None,
    num_workers: int | str = 0,
    drop_last: bool = False,
    pad: bool = True,
    dict_pairs: bool = False,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """A DataLoader over ``dataset`` with ``batch_size`` samples per batch (per rank).

    - ``dist`` with ``is_distributed``: a ``DistributedSampler(num_replicas=world_size,
      rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)``; each rank sees
      ``ceil(len / world_size)`` samples (without ``drop_last`` the sampler pads by
      repeating the first samples so every rank has as many). Call
      :func:`set_epoch` each epoch.
    - ``dist`` with ``pad=False`` (and no ``drop_last``): no sample is repeated; rank
      ``r`` gets positions ``r, r + W, ...`` of the same seeded order
      (:class:`~torchgpu.data.shards.ShardBatches`, whose ``layout`` gives every
      batch's size on every rank). Every rank yields the same number of batches, so a
      rank's last batch may be short or empty (zero rows); weight each rank's loss by
      its samples (the training loop does) for results equal to one process's.
    - otherwise, with ``shuffle``: a random order drawn from a ``torch.Generator``
      seeded with ``seed``, so runs repeat exactly and the global RNG is not touched.
    - with workers, that generator (one of its own without a shuffle) also gives the
      workers' base seed, never the global RNG.
    - ``pin_memory`` only when ``device`` is CUDA (pinning for the CPU costs time and
      buys nothing); ``num_workers`` defaults to 0, in-memory data needs no workers;
      ``"auto"`` chooses the workers and their prefetching from this process's cores
      and the device (:func:`torchgpu.data.workers.auto_choice`).

    - ``dict_pairs``: the dataset yields dicts; each collated dict ``batch`` comes out as
      ``(batch, batch)`` (:class:`torchgpu.data.batches.DictPairs`), the engine's
      ``(inputs, target)`` shape.
    - ``collate_fn``: turns a list of items into a batch (default: torch's
      ``default_collate``, whose failure on items of different shapes is one
      paragraph naming them: :class:`torchgpu.data.collate.Collate`); e.g. a padding
      collator for token sequences of different lengths. Every batch, an empty DDP
      share included (the collated first item with zero rows), goes through it.
    - a plain ``TensorDataset`` is read a batch at a time (``dataset[indices]``, one
      indexing per tensor) instead of row by row and collated: the same batches in the
      same order, bitwise, without a Python call per row (~10x less loading time for
      small rows). The loader's ``sampler`` is then the batch sampler
      (:func:`batch_sampler_of` finds it either way).

    Raises :class:`DataError` for an empty dataset, a batch size below 1, or fewer
    samples (per rank) than one batch when ``drop_last`` would leave no batch at all.
    """
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size} is not allowed: use a batch size of 1 or more")
    if not isinstance(dataset, Sized):
        raise DataError(
            f"the dataset is a {type(dataset).__name__} without len(): make_loader takes a "
            "map-style Dataset (with __len__ and __getitem__)")
    n = len(dataset)
    if n == 0:
        raise DataError("the dataset is empty: there is nothing to load; check the data source")
    # default_collate, or the given function, with failures in one paragraph
    collate = collate_fn if isinstance(collate_fn, Collate) else Collate(collate_fn)
    workers = worker_choice(num_workers, torch.device(device).type if device else "cpu",
                            in_memory=_whole_batches(dataset, dict_pairs)).loader_kwargs()
    distributed = dist is not None and dist.is_distributed
    # The loader's generator: the shuffled order's source, and with workers their base
    # seed's, reseeded per epoch by the training loop. Workers get one without a shuffle
    # too, so their seed never comes from the global RNG and a run's random state does
    # not depend on when an epoch's iterator starts (train.loop.epoch.loads_ahead).
    generator = (torch.Generator().manual_seed(seed)
                 if (shuffle and not distributed) or workers["num_workers"] > 0 else None)
    per_rank = n
    if distributed:
        assert dist is not None
        per_rank = n // dist.world_size if drop_last else -(-n // dist.world_size)
    if drop_last and per_rank < batch_size:
        where = f" per rank ({dist.world_size} ranks)" if distributed and dist else ""
        raise DataError(
            f"{n} samples give {per_rank}{where}, fewer than one batch of {batch_size}, and "
            f"drop_last is set so no batch would be made: use a batch size of {max(per_rank, 1)} "
            "or less, or more data"
        )
    if distributed and not pad and not drop_last:
        assert dist is not None
        from torchgpu.data.shards import EmptyBatchCollate, ShardBatches

        shards = ShardBatches(n, batch_size, rank=dist.rank, world_size=dist.world_size,
                              shuffle=shuffle, seed=seed)
        if collate_fn is None and _whole_batches(dataset, dict_pairs):  # zero rows itself
            return DataLoader(dataset, sampler=shards, batch_size=None,
                              collate_fn=_contiguous, generator=generator, **workers)
        return DataLoader(
            dataset,
            batch_sampler=shards,
            collate_fn=_pairs(EmptyBatchCollate(dataset, collate), dict_pairs),
            generator=generator,
            **workers,
        )
    if distributed:
        assert dist is not None
        sampler: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=dist.world_size,
            rank=dist.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        return DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            collate_fn=_pairs(collate, dict_pairs),
            generator=generator,
            **workers,
            drop_last=drop_last,
        )
    if collate_fn is None and _whole_batches(dataset, dict_pairs):
        # The sampler DataLoader would build, batched; ``generator`` stays the loader's
        # (the training loop reseeds it per epoch).
        order = (RandomSampler(dataset, generator=generator) if shuffle
                 else SequentialSampler(dataset))
        return DataLoader(dataset, sampler=BatchSampler(order, batch_size, drop_last),
                          batch_size=None, collate_fn=_contiguous, generator=generator,
                          **workers)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        collate_fn=_pairs(collate, dict_pairs),
        **workers,
        drop_last=drop_last,
    )


#: Host bytes per sample of an epoch's shuffled order: torch's samplers draw
#: ``randperm(n)`` (8 bytes an index) and turn it into a Python list (an 8-byte slot and
#: an int object of about 32 bytes each), both alive at once.
ORDER_BYTES_PER_SAMPLE = 48


def host_memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError):
        return None


def check_order_fits(samples: int, what: str) -> None:
    """DataError (before anything is written) when an epoch's shuffled order of
    ``samples`` indices -- which every sampler of the training split holds in memory --
    would need more than this machine's memory (a ``__len__`` of 2**40 fails in the
    allocator otherwise, at the first epoch)."""
    total = host_memory_bytes()
    need = samples * ORDER_BYTES_PER_SAMPLE
    if total is None or need <= total:
        return
    from torchgpu.sizes import format_bytes

    raise DataError(
        f"{what} has {samples:,} samples (its len()): shuffling an epoch holds the order of "
        f"every index in memory, about {format_bytes(need)} ({ORDER_BYTES_PER_SAMPLE} B a "
        f"sample), more than this machine's {format_bytes(total)}. Check that __len__ "
        "returns the number of samples; train on a smaller map-style Dataset (e.g. a "
        "torch.utils.data.Subset of the indices per run), or stream the data as an "
        "IterableDataset in a training loop of your own (torchgpu's needs len() and "
        "indexing)."
    )


def _whole_batches(dataset: Dataset[Any], dict_pairs: bool) -> TypeGuard[TensorDataset]:
    """Whether ``dataset`` can be read a batch at a time: a TensorDataset whose
    ``__getitem__`` is torch's (indexing each tensor with the batch's indices)."""
    kind = type(dataset)
    return (not dict_pairs and isinstance(dataset, TensorDataset)
            and kind.__getitem__ is TensorDataset.__getitem__
            and getattr(kind, "__getitems__", None) is getattr(TensorDataset, "__getitems__",
                                                                None))


def _contiguous(batch: Any) -> tuple[torch.Tensor, ...]:
    """A whole batch as collation makes it: contiguous tensors (indexing keeps a
    channels-last source's layout)."""
    return tuple(t if t.is_contiguous() else t.contiguous() for t in batch)


def batch_sampler_of(loader: DataLoader[Any]) -> object:
    """The sampler that makes ``loader``'s batches: its ``batch_sampler``, or -- for a
    loader that reads whole batches (``batch_size=None``) -- its ``sampler``."""
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def _pairs(inner: Callable[[list[Any]], Any], dict_pairs: bool) -> Any:
    return DictPairs(inner) if dict_pairs else inner


def set_epoch(loader: DataLoader[Any], epoch: int) -> None:
    """Tell a DistributedSampler (or an unpadded ShardBatches batch sampler) which epoch
    starts, so each epoch gets a new order, the same on every rank.

    Does nothing for other samplers (their seeded generator already advances per epoch).
    """
    for sampler in (loader.sampler, loader.batch_sampler):  # ShardBatches: the latter
        setter = getattr(sampler, "set_epoch", None)
        if setter is not None:
            setter(epoch)
