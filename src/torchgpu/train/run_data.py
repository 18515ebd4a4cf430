"""A run's data: its training and held-out loaders (:func:`loaders`), and each epoch's
batches (:class:`EpochStarts`), the next epoch's started while this one ends so that its
DataLoader workers fork and fill their queues meanwhile
(:func:`torchgpu.train.loop.epoch.loads_ahead`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchgpu.train import stream_run
from torchgpu.train.config import TrainConfig
from torchgpu.train.loop.epoch import EpochBatches, loads_ahead
from torchgpu.train.strategies.shard import Shard
from torchgpu.train.task import Task

#: ``start(loader, seed, epoch, skip)``: an epoch's batches (the checkpoints' start_epoch,
#: which keeps the random state a resume needs).
Start = Callable[[Any, int, int, int], EpochBatches]


class EpochStarts:
    """Each epoch's batches for the runner: taken from those started ahead, or started
    now (``skip``: a resumed epoch's trained batches). :meth:`close` ends any started
    ahead and not taken (a stop, an error, the run's end)."""

    def __init__(self, loader: Any, seed: int, epochs: int, start: Start) -> None:
        self.loader, self.seed, self.epochs, self._start = loader, seed, epochs, start
        self._ahead: list[EpochBatches] = []
        #: ``run_epoch``'s ``ahead_left``: the batches the workers hold in flight
        #: (requested, not yet trained on); once no more are left, every index of the
        #: epoch is handed out and the next epoch's workers may start.
        workers = int(getattr(loader, "num_workers", 0) or 0)
        self.in_flight = workers * int(getattr(loader, "prefetch_factor", None) or 2)

    def begin(self, epoch: int, skip: int) -> EpochBatches:
        """Epoch ``epoch``'s batches."""
        if self._ahead:
            return self._ahead.pop()
        return self._start(self.loader, self.seed, epoch, skip)

    def ahead_of(self, epoch: int) -> Callable[[], None] | None:
        """What starts epoch ``epoch``'s batches early (once; ``run_epoch``'s ``ahead``),
        None past the last epoch or where the loader cannot start early."""
        if epoch >= self.epochs or not loads_ahead(self.loader):
            return None

        def start() -> None:
            if not self._ahead:
                self._ahead.append(self._start(self.loader, self.seed, epoch, 0))
        return start

    def close(self) -> None:
        for batches in self._ahead:
            batches.close()
        self._ahead.clear()


def loaders(data: Task, config: TrainConfig, shard: Shard,
            device: torch.device) -> tuple[Any, Any]:
    """The training loader (this rank's share: a stream's, or the data set's) and the
    evaluation loader (an empty list without a test split)."""
    from torchgpu.data import make_loader

    assert config.batch_size is not None
    train_loader: Any = stream_run.train_loader(data, config, shard.rank, shard.world_size,
                                                device)
    if train_loader is None:
        train_loader = make_loader(data.train, config.batch_size, shuffle=True,
                                   seed=config.seed, dist=shard, device=device,
                                   num_workers=config.num_workers, pad=False,
                                   dict_pairs=data.dict_batches, collate_fn=data.collate_items)
    test, batch = data.test, data.eval_batch(config.batch_size)
    if test is None:
        return train_loader, []

    def held_out(workers: int | str) -> Any:
        return make_loader(test, batch, shuffle=False,
                           device=device, num_workers=workers, dict_pairs=data.dict_batches,
                           collate_fn=data.collate_items)

    # The held-out split loads as the training split does (a __getitem__ that decodes
    # is as slow in either), with no more workers than it has batches.
    test_loader = held_out(config.num_workers)
    if test_loader.num_workers > len(test_loader):
        test_loader = held_out(len(test_loader))
    return train_loader, test_loader
