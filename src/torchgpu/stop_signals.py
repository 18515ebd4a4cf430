"""The stop signals (SIGTERM: a scheduler's preemption; SIGINT: Ctrl-C) and routing them
to a handler for the length of a block.

Every part of torchgpu that answers a stop (the training flag, the launcher's forwarder,
the bench's worker start-up, the command line's first-line handler) takes the signals
from here, so they cannot disagree on which signals mean "stop".
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

Handler = Callable[[int, FrameType | None], Any]


@contextmanager
def routed_to(handler: Handler) -> Iterator[bool]:
    """Handle the stop signals with ``handler`` while the block runs, and restore the
    previous handlers after it. Only the main thread can set handlers: elsewhere the
    block runs with them as they are. Yields whether ``handler`` was installed."""
    if threading.current_thread() is not threading.main_thread():
        yield False
        return
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)
        yield True
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)
