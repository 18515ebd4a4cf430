"""The run's stop record that a launcher and its workers share, and the stop flag a
worker's signals set.

**The stop record.** A launcher (:mod:`torchgpu.launch.run`) names a file in
:data:`STOP_FILE_ENV` for its workers. The first stop signal any of them (or the
launcher) receives is written there (:func:`record_stop`), once, by whoever got it. It
is how a deliberate stop reaches the processes that did not get the signal before a
process group exists to agree through (a rank still waiting for its peers), and how the
launcher tells a stop from a failure: a stopped run is never restarted by torchrun.

**The stop flag** (:class:`StopFlag`): what SIGTERM/SIGINT set in a process that trains;
the training loop checks it at step boundaries.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from types import FrameType

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


class StopFlag:
    """Set by SIGTERM/SIGINT (or by code); the loop checks it at step boundaries.

    The handler only sets the flag: the loop saves (when checkpointing) and returns at
    the next optimizer-step boundary. A second SIGINT while the flag is already set
    raises KeyboardInterrupt as usual, so a stuck run can still be interrupted; a
    second SIGTERM only shortens the stop's bound (``signals`` counts them;
    :mod:`torchgpu.train.guards.stop_deadline`).

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
