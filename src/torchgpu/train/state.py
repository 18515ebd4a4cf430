"""Where a run stands (``TrainState``), the stop flag signals set, and the run's stop
record that a launcher and its workers share.

``TrainState`` is everything a resumed run needs besides the weights, optimizer and
RNG: which epoch, how many optimizer steps, how many micro-batches of the current
epoch were consumed, and the loss history. The data order of an epoch is a function
of ``(seed, epoch)`` (a run's training set: ``randperm`` seeded with ``seed + epoch``,
DistributedSampler's order, :mod:`torchgpu.data.shards`; a generator-shuffled loader:
:func:`torchgpu.train.loop.epoch_seed`), so a resumed run re-creates the epoch's order
and skips ``batch_in_epoch`` micro-batches.

**The stop record.** A launcher (:mod:`torchgpu.launcher`) names a file in
:data:`STOP_FILE_ENV` for its workers. The first stop signal any of them (or the
launcher) receives is written there (:func:`record_stop`), once, by whoever got it. It
is how a deliberate stop reaches the processes that did not get the signal before a
process group exists to agree through (a rank still waiting for its peers), and how the
launcher tells a stop from a failure: a stopped run is never restarted by torchrun.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from torchgpu.stop_signals import routed_to

#: The environment variable a launcher sets to the path of the run's stop record.
STOP_FILE_ENV = "TORCHGPU_STOP_FILE"
#: The stop reason of a rank whose flag was set by the ranks' agreement, not a signal.
PEER_STOP = "a stop on another rank"


def stop_file() -> str | None:
    """The path of this run's stop record (None outside a torchgpu launcher)."""
    return os.environ.get(STOP_FILE_ENV) or None


def record_stop(reason: str, rank: int | None, path: str | None = None) -> None:
    """Write the run's stop record (``path``, default :func:`stop_file`) unless there is
    one: ``reason`` (``"SIGTERM"``) and the ``rank`` that got it (None: the launcher).
    Safe in a signal handler: never raises, and the first writer wins (the record is
    linked into place whole, so a reader never sees half of it)."""
    path = path or stop_file()
    if not path or os.path.exists(path):
        return
    temporary = f"{path}.{os.getpid()}"
    try:
        with open(temporary, "w") as file:
            json.dump({"reason": reason, "rank": rank, "pid": os.getpid()}, file)
        os.link(temporary, path)
    except OSError:
        pass  # another process was first, or the launcher is gone with its directory
    finally:
        with suppress(OSError):
            os.unlink(temporary)


def clear_stop(path: str | None = None) -> None:
    """Remove the run's stop record (``path``, default :func:`stop_file`), if any: the
    launcher's, before it restarts workers whose record was not a stop."""
    path = path or stop_file()
    if path:
        with suppress(OSError):
            os.unlink(path)


def recorded_stop(path: str | None = None) -> str | None:
    """The run's stop as words (``"SIGTERM on rank 1"``, ``"SIGTERM to the launcher"``),
    or None when nobody recorded one (``path``: default :func:`stop_file`)."""
    path = path or stop_file()
    if not path:
        return None
    try:
        with open(path) as file:
            record = json.load(file)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return "a stop signal"
    if not isinstance(record, dict):
        return "a stop signal"
    reason = str(record.get("reason") or "a stop signal")
    rank = record.get("rank")
    return f"{reason} on rank {rank}" if isinstance(rank, int) else f"{reason} to the launcher"


def _own_rank() -> int | None:
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


@dataclass
class TrainState:
    """The resumable position of a run (mutable; the loop advances it).

    ``step``: optimizer steps taken. ``batch_in_epoch``: micro-batches of ``epoch``
    already consumed (0 at an epoch start). ``step_losses``: mean loss of each optimizer
    step, in order; ``step_lrs``: the learning rate each step used (the first parameter
    group's; :mod:`torchgpu.train.schedule`). ``epoch_losses``: (train, test) loss per
    finished epoch.
    """

    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    samples: int = 0  # training samples seen by this process
    skipped_steps: int = 0  # optimizer steps dropped for a non-finite loss
    epoch_start_step: int = 0  # value of ``step`` when ``epoch`` began
    epoch_loss_sum: float = 0.0  # sum of this epoch's finite micro-batch losses so far
    epoch_loss_count: int = 0
    step_losses: list[float] = field(default_factory=list)
    step_lrs: list[float] = field(default_factory=list)
    epoch_losses: list[tuple[float, float]] = field(default_factory=list)

    def begin_epoch(self, epoch: int) -> None:
        """Move to the start of ``epoch`` (fresh position and epoch-loss sums)."""
        self.epoch = epoch
        self.batch_in_epoch = 0
        self.epoch_start_step = self.step
        self.epoch_loss_sum = 0.0
        self.epoch_loss_count = 0

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (ints, floats, lists): safe for weights-only loading."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "batch_in_epoch": self.batch_in_epoch,
            "samples": self.samples,
            "skipped_steps": self.skipped_steps,
            "epoch_start_step": self.epoch_start_step,
            "epoch_loss_sum": self.epoch_loss_sum,
            "epoch_loss_count": self.epoch_loss_count,
            "step_losses": list(self.step_losses),
            "step_lrs": list(self.step_lrs),
            "epoch_losses": [list(pair) for pair in self.epoch_losses],
        }

    @classmethod
    def from_saved(cls, data: object) -> TrainState:
        """:meth:`from_dict` of what a checkpoint holds, checked first: a ``ValueError``
        whose message names the first field that is not what :meth:`to_dict` writes
        (``step_losses is a str; expected a list of numbers...``), so a damaged state
        is refused before the run uses it."""
        if not isinstance(data, dict):
            raise ValueError(f"train_state is a {type(data).__name__}; expected a dict "
                             "of the run's position")
        for name in ("epoch", "step", "batch_in_epoch", "samples", "skipped_steps",
                     "epoch_start_step", "epoch_loss_count"):
            value = data.get(name, None if name in ("epoch", "step", "batch_in_epoch") else 0)
            if not _count(value):
                raise ValueError(f"train_state.{name} is {_shown(value)}; expected a "
                                 "non-negative integer")
        if not _number(data.get("epoch_loss_sum", 0.0)):
            raise ValueError(f"train_state.epoch_loss_sum is "
                             f"{_shown(data.get('epoch_loss_sum'))}; expected a number")
        losses = data.get("step_losses", [])
        if not isinstance(losses, list) or not all(_number(v) for v in losses):
            raise ValueError(f"train_state.step_losses is {_shown(losses)}; expected a list "
                             "of numbers, the mean loss of each optimizer step")
        if len(losses) != data["step"]:
            raise ValueError(f"train_state.step is {data['step']} but train_state."
                             f"step_losses holds {len(losses)} losses; expected one per "
                             "optimizer step")
        pairs = data.get("epoch_losses", [])
        if not isinstance(pairs, list) or not all(
                isinstance(p, list | tuple) and len(p) == 2 and all(_number(v) for v in p)
                for p in pairs):
            raise ValueError(f"train_state.epoch_losses is {_shown(pairs)}; expected a list "
                             "of (train, test) loss pairs, one per finished epoch")
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainState:
        return cls(
            epoch=int(data["epoch"]),
            step=int(data["step"]),
            batch_in_epoch=int(data["batch_in_epoch"]),
            samples=int(data.get("samples", 0)),
            skipped_steps=int(data.get("skipped_steps", 0)),
            epoch_start_step=int(data.get("epoch_start_step", 0)),
            epoch_loss_sum=float(data.get("epoch_loss_sum", 0.0)),
            epoch_loss_count=int(data.get("epoch_loss_count", 0)),
            step_losses=[float(v) for v in data.get("step_losses", [])],
            step_lrs=[float(v) for v in data.get("step_lrs", [])],
            epoch_losses=[(float(a), float(b)) for a, b in data.get("epoch_losses", [])],
        )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown(value: object) -> str:
    """``value`` for a message: its type and, when short, itself."""
    text = repr(value)
    return f"{type(value).__name__} {text}" if len(text) <= 40 else f"a {type(value).__name__}"


class StopFlag:
    """Set by SIGTERM/SIGINT (or by code); the loop checks it at step boundaries.

    The handler only sets the flag: the loop saves (when checkpointing) and returns at
    the next optimizer-step boundary. A second SIGINT while the flag is already set
    raises KeyboardInterrupt as usual, so a stuck run can still be interrupted; a
    second SIGTERM only shortens the stop's bound (``signals`` counts them;
    :mod:`torchgpu.train.stop_deadline`).

    ``signal_name``: why the run stops (``"SIGTERM"``, ``"step limit"``; under DDP
    ``"SIGTERM on rank 1"`` on the ranks that got no signal). ``steps_by_rank``: set
    under DDP when the ranks agreed to stop, the optimizer step each rank stopped at.
    A signal is also written to the run's stop record (:func:`record_stop`), which
    :meth:`requested` reads: the stop of a peer that cannot be agreed on yet.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        # ``is_set()``: whether the flag is set. The loop asks at every step boundary, so
        # it is the Event's own method (one Python call, not two).
        self.is_set: Callable[[], bool] = self._event.is_set
        self.signal_name: str | None = None
        self.steps_by_rank: list[int] | None = None
        self.signals = 0  # stop signals received (a second one shortens the stop's bound)

    def set(self, reason: str = "request") -> None:
        self.signal_name = self.signal_name or reason
        self._event.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        if signum == signal.SIGINT and self.is_set():
            raise KeyboardInterrupt
        name = signal.Signals(signum).name
        self.set(name)
        record_stop(name, _own_rank())

    def requested(self) -> bool:
        """This flag, or a stop any process of the run recorded (:func:`recorded_stop`):
        for waits that happen before the ranks can agree (their group is forming)."""
        if self.is_set():
            return True
        peer = recorded_stop()
        if peer is None:
            return False
        self.set(peer)
        return True

    @contextmanager
    def installed(self) -> Iterator[StopFlag]:
        """Route SIGTERM and SIGINT to this flag while the block runs (main thread only)."""
        with routed_to(self._handle):
            yield self
