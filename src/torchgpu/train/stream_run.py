"""A run's streamed training data (:mod:`torchgpu.data.stream`): the checks before
``--out`` exists, the training loader, and what the run reports about the stream.

Resume continues from the stream's saved state when it keeps one, else reads the
epoch's stream from its start again and drops the items already trained
(:mod:`torchgpu.data.stream_loader`; ``"stream_resume"`` in summary.json). An epoch
whose stream ends before ``--steps-per-epoch`` is over ends there with a warning (each
epoch reads the stream anew, so the next epoch runs again); summary.json lists such
epochs under ``"stream_short_epochs"``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from torchgpu.data.loader import batch_sampler_of
from torchgpu.data.shards import ShardLayout
from torchgpu.data.stream import STEPS_FLAG, is_stream, splits_over_workers, stream_batches
from torchgpu.data.stream_loader import StreamLoader, stream_loader
from torchgpu.errors import UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.task import Task


def check_stream(task: Task, config: TrainConfig, world_size: int) -> None:
    """Before anything is written: a stream's epoch length can be known (UsageError
    naming ``--steps-per-epoch`` otherwise), it holds one optimizer step (DataError
    naming the counts), and ``--steps-per-epoch`` is not given for map-style data."""
    if not is_stream(task.train):
        if config.steps_per_epoch is not None:
            raise UsageError(
                f"--steps-per-epoch {config.steps_per_epoch} is for streamed training data "
                "(an IterableDataset); this training data is a map-style dataset whose "
                "epoch is its length: drop --steps-per-epoch (fit: steps_per_epoch)."
            )
        return
    if (isinstance(config.num_workers, int) and config.num_workers > 0
            and splits_over_workers(task.train)):
        raise UsageError(
            f"--num-workers {config.num_workers} with a datasets stream "
            f"({type(task.train).__name__}): it hands each DataLoader worker only its own "
            "shards, and torchgpu shards the stream over the ranks and workers itself, so "
            "items would be lost. Use --num-workers 0, or split the stream over the ranks "
            "with datasets.distributed.split_dataset_by_node(dataset, rank, world_size) "
            "(it then shards itself over ranks and workers, and torchgpu takes its batches "
            "as they come)."
        )
    stream_batches(task.train, config.batch_size or 1, world_size, config.accumulate,
                   config.steps_per_epoch)


def train_loader(task: Task, config: TrainConfig, rank: int, world_size: int,
                 device: torch.device) -> StreamLoader | None:
    """The training loader of a stream (None for map-style data): this rank's batches
    of the epoch."""
    if not is_stream(task.train):
        return None
    assert config.batch_size is not None
    batches = stream_batches(task.train, config.batch_size, world_size, config.accumulate,
                             config.steps_per_epoch)
    from torchgpu.data.workers import worker_choice

    workers = worker_choice(config.num_workers, device.type).num_workers
    if not isinstance(config.num_workers, int) and splits_over_workers(task.train):
        workers = 0  # auto: a datasets stream would hand each worker only its own shards
    return stream_loader(task.train, config.batch_size, batches=batches, rank=rank,
                         world_size=world_size, collate=task.collate, device=device,
                         num_workers=workers)


def layout_of(loader: Any) -> ShardLayout | None:
    """How the training loader's epoch falls on the ranks (the loop's tail weights)."""
    if isinstance(loader, StreamLoader):
        return loader.dataset.layout
    return getattr(batch_sampler_of(loader), "layout", None)


def position_of(loader: Any) -> StreamLoader | None:
    """The loader whose position a checkpoint keeps (a stream's), else None."""
    return loader if isinstance(loader, StreamLoader) else None


class StreamReport:
    """Epochs whose stream ended early (warned at the first, on rank 0) and the summary's
    ``stream_*`` keys; inert for map-style data."""

    def __init__(self, loader: Any, is_main: bool) -> None:
        self.loader = position_of(loader)
        self.active = self.loader is not None
        self.is_main = is_main
        self.short: list[int] = []

    def epoch_end(self, epoch: int, batches: int, batches_per_epoch: int,
                  accumulate: int) -> None:
        """Epoch ``epoch`` (0-based) ended after ``batches`` micro-batches."""
        if not self.active or batches >= batches_per_epoch:
            return
        self.short.append(epoch + 1)
        if self.is_main and len(self.short) == 1:  # once: the epochs alike are listed
            steps = -(-batches // accumulate)
            print(f"torchgpu: warning: the training stream ended after {batches} of the "
                  f"epoch's {batches_per_epoch} micro-batches (epoch {epoch + 1}: {steps} of "
                  f"{-(-batches_per_epoch // accumulate)} steps); the epoch ends there. Set "
                  f"{STEPS_FLAG} to at most {steps} to match the stream.", file=sys.stderr)

    def summary(self) -> dict[str, Any]:
        """``stream_resume``: how this run resumed mid-epoch, or how a resume of it
        would (``state_dict``: the stream's saved state; ``skip``: reading past the
        trained items); ``stream_short_epochs``: the epochs (1-based) the stream ended."""
        if self.loader is None:
            return {}
        how = self.loader.resumed_by or ("state_dict" if self.loader.kind else "skip")
        return {"stream_resume": how, "stream_short_epochs": list(self.short)}
