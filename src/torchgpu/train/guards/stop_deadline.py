"""A stop that ends: the bound between a stop signal and the step boundary it waits for.

The loop honours a set stop flag at its next optimizer-step boundary, but a step that never
ends (a DataLoader worker stuck in ``__getitem__``) would make that wait endless.
:class:`StopDeadline` gives the run ``--stop-timeout`` seconds (default 30) from the flag to
the boundary; a second stop signal shortens what is left to :data:`SECOND_SIGNAL_S`. Past
the deadline a watcher thread lets a checkpoint being written finish, kills the process's
children, prints one line and exits with 128 + the signal's number (143 for SIGTERM),
without a checkpoint of the stop: ``--resume`` continues from the newest one before.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from torchgpu.launch.stop import child_pids
from torchgpu.launch.stop_record import StopFlag

#: After a second stop signal, the most the run may still take to reach a step boundary.
SECOND_SIGNAL_S = 5.0
_POLL_S = 0.1


class StopDeadline:
    """Ends the process when ``flag``'s stop does not reach a step boundary in time.

    ``timeout_s``: seconds from the flag being set to :meth:`reached`. ``saving``: a lock
    held while a checkpoint is written (the deadline waits for it). ``newest``: the
    newest checkpoint written so far (for the message), or None. Use :meth:`watching`
    around the training loop; call ``reached`` at the boundary where the stop is
    honoured (the save of the stop that follows is not bounded by this deadline).
    """

    def __init__(self, flag: StopFlag, timeout_s: float, saving: Any = None,
                 newest: Any = None) -> None:
        self.flag = flag
        self.timeout_s = timeout_s
        self.saving = saving if saving is not None else threading.Lock()
        self.newest = newest if newest is not None else (lambda: None)
        self._done = threading.Event()

    def reached(self) -> None:
        """The loop reached the step boundary where it honours the stop."""
        self._done.set()

    @contextmanager
    def watching(self) -> Iterator[StopDeadline]:
        """Watch the flag while the block runs (a daemon thread)."""
        thread = threading.Thread(target=self._watch, name="torchgpu-stop-deadline",
                                  daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._done.set()
            thread.join(timeout=1)

    def _watch(self) -> None:
        deadline: float | None = None
        signals = 0
        while not self._done.wait(_POLL_S):
            if not self.flag.is_set():
                continue
            now = time.monotonic()
            if deadline is None:
                deadline, signals = now + self.timeout_s, self.flag.signals
            elif self.flag.signals > signals:  # another signal: do not wait much longer
                deadline, signals = min(deadline, now + SECOND_SIGNAL_S), self.flag.signals
            if now >= deadline:
                with self.saving:  # a checkpoint being written is finished first
                    if not self._done.is_set():
                        self._end()
                return

    def _end(self) -> None:
        """Kill the children (DataLoader workers), say why, exit 128 + the signal."""
        reason = self.flag.signal_name or "a stop"
        name = reason.split(" ", 1)[0]
        sig = signal.Signals[name] if name in signal.Signals.__members__ else signal.SIGTERM
        newest = self.newest()
        kept = (f"the newest checkpoint, {newest}, is intact: resume from it with --resume"
                if newest is not None else "no checkpoint had been written")
        print(f"torchgpu: stopped by {reason}, but the run did not reach a step boundary "
              f"within {self.timeout_s:g} s (--stop-timeout; a second signal shortens it to "
              f"{SECOND_SIGNAL_S:g} s): the step in progress, its data loading included, "
              f"did not end (a DataLoader worker stuck in __getitem__?). Ended without "
              f"saving the stop; {kept}.", file=sys.stderr, flush=True)
        with suppress(Exception):
            sys.stdout.flush()
        for pid in child_pids():  # the DataLoader workers: none outlives this process
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        os._exit(128 + int(sig))
