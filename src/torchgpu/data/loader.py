"""make_loader: one DataLoader recipe for one process, DDP ranks, CPU and CUDA.

Under DDP each rank gets a :class:`~torch.utils.data.distributed.DistributedSampler`
shard. The caller must call ``loader.sampler.set_epoch(epoch)`` at the start of every
epoch (see :func:`set_epoch`), or every epoch repeats the first epoch's order.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from torchgpu.errors import DataError


class RankInfo(Protocol):
    """What make_loader reads from a :class:`torchgpu.distributed.DistEnv`."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_distributed(self) -> bool: ...


def make_loader(
    dataset: Dataset[Any],
    batch_size: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    dist: RankInfo | None = None,
    device: torch.device | str | None = None,
    num_workers: int = 0,
    drop_last: bool = False,
) -> DataLoader[Any]:
    """A DataLoader over ``dataset`` with ``batch_size`` samples per batch (per rank).

    - ``dist`` with ``is_distributed``: a ``DistributedSampler(num_replicas=world_size,
      rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)``; each rank sees
      ``ceil(len / world_size)`` samples (without ``drop_last`` the sampler pads by
      repeating the first samples so every rank has as many). Call
      :func:`set_epoch` each epoch.
    - otherwise, with ``shuffle``: a random order drawn from a ``torch.Generator``
      seeded with ``seed``, so runs repeat exactly and the global RNG is not touched.
    - ``pin_memory`` only when ``device`` is CUDA (pinning for the CPU costs time and
      buys nothing); ``num_workers`` defaults to 0, in-memory data needs no workers.

    Raises :class:`DataError` for an empty dataset, a batch size below 1, or fewer
    samples (per rank) than one batch when ``drop_last`` would leave no batch at all.
    """
    if batch_size < 1:
        raise DataError(f"batch_size={batch_size} is not allowed: use a batch size of 1 or more")
    n = len(dataset)  # type: ignore[arg-type]
    if n == 0:
        raise DataError("the dataset is empty: there is nothing to load; check the data source")
    pin = device is not None and torch.device(device).type == "cuda"
    distributed = dist is not None and dist.is_distributed
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
            num_workers=num_workers,
            pin_memory=pin,
            drop_last=drop_last,
        )
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        num_workers=num_workers,
        pin_memory=pin,
        drop_last=drop_last,
    )


def set_epoch(loader: DataLoader[Any], epoch: int) -> None:
    """Tell a DistributedSampler which epoch starts, so each epoch gets a new order.

    Does nothing for other samplers (their seeded generator already advances per epoch).
    """
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(epoch)
