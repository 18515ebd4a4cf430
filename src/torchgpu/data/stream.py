"""Streamed training data: an ``IterableDataset`` cut into this process's batches.

A stream (a ``torch.utils.data.IterableDataset``: a corpus read from disk, a Hugging
Face ``datasets`` stream) has no indexing and often no length. :class:`StreamBatches`
turns it into the batches one process trains on:

- **Epochs.** Every epoch reads the stream from its start (``iter(dataset)`` anew,
  after ``dataset.set_epoch(epoch)`` when the stream has one, so a shuffling stream
  reshuffles) and takes ``batches`` micro-batches of it: ``steps_per_epoch x
  accumulate``, or, for a stream with ``len()``, all of it. A stream without ``len()``
  needs a step count (:func:`stream_batches` refuses it otherwise).
- **Sharding.** Global item ``i`` of the stream (counted from the epoch's start) goes
  to rank ``i mod W``; the rank's items are cut into batches of ``batch_size`` in
  order, and rank-local batch ``b`` is made by DataLoader worker ``(b - s) mod K``
  (``s``: the pass's first batch, 0 but on a resume). So every item is trained on
  by exactly one rank and one worker, batch ``b`` of all
  ranks together holds global items ``[b*G, (b+1)*G)`` (``G = W x batch_size``, the
  one-process batch of the same global size), and the batches do not depend on the
  number of workers (the DataLoader takes the workers' batches in turn). Every rank
  and worker reads the whole stream and keeps its own items.
- **A stream that shards itself** (it reads ``torch.distributed``'s rank and
  ``get_worker_info()`` and yields only its own items, or a ``datasets`` stream split
  with ``split_dataset_by_node``) is not sharded again: it says so with a
  ``shards_itself = True`` attribute (:func:`shards_itself`). Its items are cut into
  batches as they come, worker ``k`` making rank-local batches ``k, k + K, ...``;
  every rank must then receive enough items for the epoch's batches (under DDP a
  rank with fewer batches leaves the others waiting in a collective).
- **The end.** A stream with ``len()`` keeps its last, short global batch (the
  :attr:`StreamBatches.layout` describes it, and the training loop weights the
  ranks' shares by their samples, as for map-style data). A stream without ``len()``
  that ends inside a global batch drops those last fewer-than-``G`` items (its end is
  only known once read), so every batch the loop sees is full. A stream that ends
  before ``batches`` ends the epoch there (the runner warns).
- **Resume** skips: :meth:`StreamBatches.begin_epoch` with ``skip`` reads and drops
  the items of the epoch's first ``skip`` batches without collating them, so a
  stream that yields the same items each time it is read resumes bitwise; or, for a
  stream with ``state_dict()``/``load_state_dict()``, :meth:`StreamBatches.state_dict`
  holds the pass's position and the stream's state
  (:mod:`torchgpu.data.stream_loader`).
"""

from __future__ import annotations

import copy
import itertools
from collections import deque
from collections.abc import Callable, Iterator, Sized
from typing import Any, TypeVar

from torch.utils.data import IterableDataset, default_collate, get_worker_info

from torchgpu.data.shards import ShardLayout, _zero_rows
from torchgpu.errors import DataError, UsageError

T = TypeVar("T")
STEPS_FLAG = "--steps-per-epoch N (fit: steps_per_epoch=N)"


def has_state(dataset: object) -> bool:
    """Whether ``dataset`` keeps its position: callable ``state_dict()`` and
    ``load_state_dict()`` (torchdata's ``Stateful``; a ``datasets`` stream)."""
    return all(callable(getattr(dataset, name, None))
               for name in ("state_dict", "load_state_dict"))


def splits_over_workers(dataset: object) -> bool:
    """Whether ``dataset`` splits itself over DataLoader workers whether asked or not:
    a ``datasets`` stream (by its shards) that is not split over the ranks by
    ``split_dataset_by_node`` (then it shards itself over both, :func:`shards_itself`)."""
    hf = type(dataset).__module__.split(".")[0] == "datasets"
    return hf and not shards_itself(dataset)


def is_stream(dataset: object) -> bool:
    """Whether ``dataset`` is a stream (an ``IterableDataset``), not map-style data."""
    return isinstance(dataset, IterableDataset)


def shards_itself(dataset: object) -> bool:
    """Whether ``dataset`` yields only this rank's (and worker's) items itself: its
    ``shards_itself`` attribute is true, or it is a ``datasets`` stream already split
    over the ranks by ``split_dataset_by_node``."""
    if getattr(dataset, "shards_itself", False):
        return True
    hf = type(dataset).__module__.split(".")[0] == "datasets"
    return hf and getattr(dataset, "_distributed", None) is not None


def first_items(dataset: Any, count: int) -> list[Any]:
    """The first ``count`` items of a fresh pass over ``dataset`` (fewer when it ends
    sooner); the training's own passes are not touched. DataError naming the failure
    when reading fails."""
    return _read(dataset, lambda items: list(itertools.islice(items, count)))


def count_items(dataset: Any, most: int) -> int:
    """How many items a fresh pass over ``dataset`` yields, counting up to ``most``
    (none is kept)."""
    return _read(dataset, lambda items: sum(1 for _ in itertools.islice(items, most)))


def _read(dataset: Any, how: Callable[[Iterator[Any]], T]) -> T:
    try:
        return how(iter(dataset))
    except Exception as error:  # the user's __iter__: any failure is theirs to fix
        from torchgpu.errors import first_line

        raise DataError(
            f"reading the first items of the training stream ({type(dataset).__name__}) "
            f"failed ({first_line(error)}): its __iter__ must yield (inputs, target) pairs "
            "or dicts of tensors"
        ) from None


def stream_length(dataset: object) -> int | None:
    """``len(dataset)``, or None for a stream without a length."""
    if not isinstance(dataset, Sized):
        return None
    try:
        return len(dataset)
    except TypeError:  # e.g. an IterableDataset whose __len__ raises
        return None


def stream_batches(dataset: object, batch_size: int, world_size: int, accumulate: int,
                   steps_per_epoch: int | None) -> int:
    """Micro-batches per epoch on every rank for a stream: ``steps_per_epoch x
    accumulate``, or all of a stream with ``len()``.

    Refuses (before anything is written) a stream without ``len()`` and no step count
    (UsageError naming the flag), and a stream that ends before the first optimizer
    step (DataError naming the counts: it reads up to one step's items to know).
    """
    length = stream_length(dataset)
    global_batch = batch_size * world_size
    if steps_per_epoch is None and length is None:
        raise UsageError(
            f"the training data is a stream ({type(dataset).__name__}, an IterableDataset) "
            f"without len(), so an epoch has no natural end: give its length in optimizer "
            f"steps with {STEPS_FLAG}; each epoch then reads the stream from its start "
            "for that many steps (or give the dataset a __len__)."
        )
    batches = (steps_per_epoch * accumulate if steps_per_epoch is not None
               else -(-int(length or 0) // global_batch))
    step = global_batch * accumulate
    seen = length if length is not None else (
        None if shards_itself(dataset) else count_items(dataset, step))
    if seen is not None and seen < step:
        raise DataError(
            f"the training stream ({type(dataset).__name__}) holds {seen} items, fewer "
            f"than one optimizer step of {step} ({world_size} process(es) x batch size "
            f"{batch_size} x accumulate {accumulate}): use a smaller batch size, fewer "
            "processes or less accumulation, or more data."
        )
    return batches


class StreamBatches(IterableDataset[Any]):
    """Rank ``rank``'s batches of ``source`` for one epoch (see the module docstring).

    ``batches``: micro-batches per epoch. ``length``: the stream's ``len()`` (None:
    unknown). ``collate``: items -> batch (``default_collate`` by default). Call
    :meth:`begin_epoch` before each pass (the training loop's ``start_epoch`` does).
    """

    def __init__(self, source: Any, batch_size: int, *, rank: int = 0, world_size: int = 1,
                 batches: int, length: int | None = None,
                 collate: Callable[[list[Any]], Any] | None = None) -> None:
        self.source = source
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.batches, self.length = batches, length
        self.collate = collate or default_collate
        self.self_sharded = shards_itself(source)
        self.epoch, self.skip = 0, 0
        self.origin = 0  # the pass's batch that worker 0 makes (see _sharded)
        self.workers = 1  # DataLoader workers (the loader sets it): aligns _own's skip
        self.position = 0  # the next rank-local batch index this pass reads
        self._reading = False  # this pass has read from the stream (its state is live)
        self._restored: dict[str, Any] | None = None  # load_state_dict's, for the next pass

    @property
    def layout(self) -> ShardLayout:
        """The epoch's batches over the ranks: a stream with ``len()`` may end in a
        short global batch (weighted by samples in the loop); without one every batch
        is full (a short end is dropped)."""
        full = self.batches * self.batch_size * self.world_size
        samples = full if self.length is None else min(self.length, full)
        return ShardLayout(samples, self.world_size, self.batch_size)

    def __len__(self) -> int:
        return self.batches

    def begin_epoch(self, epoch: int, skip: int = 0) -> int:
        """The next pass is epoch ``epoch``, resuming after its first ``skip`` batches;
        returns the batches the caller still has to load and drop: none, except for a
        stream that shards itself over workers (its worker ``k`` always makes batches
        ``k, k + K, ...``, so the pass starts at a multiple of ``K``)."""
        left = skip % self.workers if self.self_sharded else 0
        self.epoch, self.skip = epoch, skip - left
        self.origin = self.position = self.skip
        self._reading = False
        setter = getattr(self.source, "set_epoch", None)
        if callable(setter):
            setter(epoch)
        return left

    def state_dict(self) -> dict[str, Any]:
        """Where this pass stands: the epoch, the next batch index it reads and the
        stream's own ``state_dict()`` (read after the last batch's items; streams with
        state only, see :func:`has_state`). Before the pass reads anything (a worker's
        first state) the stream's state is None: the pass starts afresh."""
        source = copy.deepcopy(self.source.state_dict()) if self._reading else None
        return {"epoch": self.epoch, "position": self.position, "origin": self.origin,
                "source": source}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next pass continues from ``state`` (the stream's state is loaded, nothing
        is read to skip); the pass after it starts afresh."""
        self._restored = dict(state)

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if self.self_sharded:
            return self._own(worker, workers)
        return self._sharded(worker, workers)

    def _start(self) -> Iterator[Any] | None:
        """A restored pass's item iterator, continuing the saved stream state; None for
        a pass from the stream's start (a state saved before its pass read anything
        sets where that pass skips to)."""
        restored, self._restored = self._restored, None
        self._reading = True
        if restored is None:
            return None
        self.origin = int(restored["origin"])
        if restored["source"] is None:
            self.skip = int(restored["position"])
            return None
        self.source.load_state_dict(restored["source"])
        self.position = int(restored["position"])
        items: Iterator[Any] = iter(self.source)
        return items

    def _sharded(self, worker: int, workers: int) -> Iterator[Any]:
        width = self.batch_size * self.world_size
        items = self._start()
        index = self.position
        if items is None:
            items, index = iter(self.source), self.skip
            _drop(items, index * width)  # every batch before a resume was full
        while index < self.batches:
            chunk = list(itertools.islice(items, width))
            if not chunk or (len(chunk) < width and self.length is None):
                return  # the end; an unannounced short end is dropped (see above)
            self.position = index + 1
            if (index - self.origin) % workers == worker:  # DataLoader's turn order
                mine = chunk[self.rank::self.world_size]
                yield self.collate(mine) if mine else self._empty(chunk[0])
            if len(chunk) < width:
                return
            index += 1

    def _own(self, worker: int, workers: int) -> Iterator[Any]:
        """A self-sharding stream: its items are this rank's (and worker's) already."""
        items = self._start()
        index = self.position
        if items is None:
            done = max(0, -(-(self.skip - worker) // workers))  # own batches before skip
            items, index = iter(self.source), worker + done * workers
            _drop(items, done * self.batch_size)
        while index < self.batches:
            chunk = list(itertools.islice(items, self.batch_size))
            if len(chunk) < self.batch_size:
                return
            self.position = index + workers
            yield self.collate(chunk)
            index += workers

    def _empty(self, item: Any) -> Any:
        """A batch of zero rows shaped like ``item``'s (a rank's empty share of the
        stream's last batch), as the collate function makes it."""
        batch = self.collate([item])
        if isinstance(batch, tuple) and len(batch) == 2 and batch[0] is batch[1]:
            empty = _zero_rows(batch[0])  # DictPairs: (batch, batch), one object
            return empty, empty
        return _zero_rows(batch)


def _drop(items: Iterator[Any], count: int) -> None:
    deque(itertools.islice(items, count), maxlen=0)
