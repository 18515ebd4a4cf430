"""The training loader of a stream, and its position for an exact resume.

:class:`StreamLoader` iterates :class:`~torchgpu.data.stream.StreamBatches` through a
DataLoader and keeps, for a stream with its own state (:func:`~torchgpu.data.stream.has_state`),
the loader's state after each of the last few batches it handed out, so a checkpoint
taken at a step boundary gets the state right after the batches trained so far, also
when a prefetcher has read ahead. Two ways to hold that state:

- torchdata's ``StatefulDataLoader`` (when ``torchdata`` is installed): every worker's
  stream state travels with its batches, so ``--num-workers N`` resumes from the
  state too;
- without torchdata, one process (``--num-workers 0``): the batches' own
  ``state_dict()`` (the stream's state and the next batch), read in this process.

A resume loads the saved state (``"stream_resume": "state_dict"``): nothing already
trained is read again. Otherwise -- a stream without state, workers without torchdata,
a state saved by the other kind of loader -- the pass skips the trained items
(``"skip"``), which is exact for a stream that yields the same items on every pass.
"""

from __future__ import annotations

import importlib
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils.data import DataLoader

from torchgpu.data.stream import StreamBatches, has_state, stream_length

KEPT = 8  # states kept: a prefetcher reads at most a few batches ahead of the step


def _stateful_loader() -> type[DataLoader[Any]] | None:
    try:  # by name: the optional package ships no type information
        module = importlib.import_module("torchdata.stateful_dataloader")
    except ImportError:  # an optional dependency: the fallbacks in the module docstring
        return None
    loader: type[DataLoader[Any]] = module.StatefulDataLoader
    return loader


@contextmanager
def _quiet() -> Iterator[None]:
    """torchdata 0.11 calls a torch API that newer torch deprecates: not the user's
    concern, so its warning is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        yield


def _as_is(batch: Any) -> Any:
    return batch


class StreamLoader:
    """This rank's batches of a stream, epoch by epoch (``len()``: batches per epoch).

    The training loop calls :meth:`begin_epoch` before each pass; the checkpoints ask
    :meth:`position_state` at a save and hand :meth:`resume_from` the saved value.
    """

    def __init__(self, shard: StreamBatches, *, num_workers: int = 0, pin: bool = False
                 ) -> None:
        self.dataset = shard
        shard.workers = max(1, num_workers)
        stateful = _stateful_loader() if has_state(shard.source) else None
        self.kind = ("torchdata" if stateful is not None else
                     "batches" if has_state(shard.source) and num_workers == 0 else None)
        kind: Callable[..., DataLoader[Any]] = stateful or DataLoader
        with _quiet():
            self.loader = kind(shard, batch_size=None, collate_fn=_as_is,
                               num_workers=num_workers, pin_memory=pin)
        self._states: deque[tuple[int, int, Any]] = deque(maxlen=KEPT)
        self._epoch, self._first = 0, 0
        self._saved: tuple[int, int, dict[str, Any]] | None = None
        self.resumed_by: str | None = None  # "state_dict" | "skip" once a resume began

    def __len__(self) -> int:
        return self.dataset.batches

    # How it loads, as a DataLoader says it (summary.json's data_loader)
    @property
    def num_workers(self) -> int:
        return int(self.loader.num_workers)

    @property
    def pin_memory(self) -> bool:
        return bool(self.loader.pin_memory)

    @property
    def prefetch_factor(self) -> int | None:
        return self.loader.prefetch_factor

    @property
    def persistent_workers(self) -> bool:
        return bool(self.loader.persistent_workers)

    def begin_epoch(self, epoch: int, skip: int = 0) -> int:
        """The next pass is epoch ``epoch`` from batch ``skip``: from a saved state when
        one was handed to :meth:`resume_from` for this very position, else by skipping
        the first ``skip`` batches' items. Returns the batches left to drop (none)."""
        saved, self._saved = self._saved, None
        self._epoch, self._first = epoch, skip
        self._states.clear()
        if saved is not None and saved[:2] == (epoch, skip) and skip > 0:
            self.dataset.begin_epoch(epoch, 0)
            state = saved[2]["state"]
            if self.kind == "torchdata":
                self.loader.load_state_dict(state)  # type: ignore[attr-defined]
            else:
                self.dataset.load_state_dict(state)
            self.resumed_by = "state_dict"
            return 0
        if skip > 0 and self.resumed_by is None:
            self.resumed_by = "skip"
        left = self.dataset.begin_epoch(epoch, skip)
        self._first = skip - left  # the batches the caller drops are counted too
        return left

    def __iter__(self) -> Iterator[Any]:
        # Made now, as a DataLoader's is: it draws its base seed from the torch RNG here
        # (the resume replays the epoch's RNG around this call).
        with _quiet():
            batches = iter(self.loader)
        return batches if self.kind is None else self._kept(batches)

    def _kept(self, batches: Iterator[Any]) -> Iterator[Any]:
        count = self._first
        for batch in batches:
            count += 1
            self._states.append((self._epoch, count, self._snapshot()))
            yield batch

    def _snapshot(self) -> Any:
        if self.kind == "torchdata":
            return self.loader.state_dict()  # type: ignore[attr-defined]
        return self.dataset.state_dict()

    def position_state(self, epoch: int, batch: int) -> dict[str, Any] | None:
        """The state to resume epoch ``epoch`` after its first ``batch`` batches (None:
        not kept; the resume then skips)."""
        for at_epoch, at_batch, state in reversed(self._states):
            if (at_epoch, at_batch) == (epoch, batch):
                return {"kind": self.kind, "epoch": epoch, "batch": batch, "state": state}
        return None

    def resume_from(self, saved: object) -> None:
        """A checkpoint's :meth:`position_state`: used by the next :meth:`begin_epoch`
        at that position when it was saved by this kind of loader."""
        if (isinstance(saved, dict) and saved.get("kind") == self.kind
                and self.kind is not None):
            self._saved = (int(saved["epoch"]), int(saved["batch"]), saved)


def stream_loader(dataset: Any, batch_size: int, *, batches: int, rank: int = 0,
                  world_size: int = 1, collate: Callable[[list[Any]], Any] | None = None,
                  device: torch.device | str | None = None,
                  num_workers: int = 0) -> StreamLoader:
    """A :class:`StreamLoader` over :class:`StreamBatches` of ``dataset`` (whole batches,
    made in the workers). Pinned memory only for CUDA."""
    shard = StreamBatches(dataset, batch_size, rank=rank, world_size=world_size,
                          batches=batches, length=stream_length(dataset), collate=collate)
    pin = device is not None and torch.device(device).type == "cuda"
    return StreamLoader(shard, num_workers=num_workers, pin=pin)
