"""While `torchgpu bench` starts worker processes, SIGTERM/SIGINT wait until every started
worker is recorded (else a worker the group does not know outlives the bench and fails
to unpickle its queues once the bench is gone). The signal must be held even when other
threads exist (a queue's feeder thread does not block it, and Python would run the
handler in the main thread at once), and delivered, once each, on leaving."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from torchgpu.bench.workers import _signals_held


class Stop(Exception):
    pass


@pytest.fixture
def raising_handlers() -> Iterator[list[int]]:
    got: list[int] = []

    def handler(signum: int, frame: object) -> None:
        got.append(signum)
        raise Stop(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield got
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def test_a_signal_is_held_while_other_threads_run_and_raised_on_leaving(
        raising_handlers: list[int]) -> None:
    done = threading.Event()
    other = threading.Thread(target=done.wait, daemon=True)  # a thread that blocks nothing
    other.start()
    steps = 0
    finished = False
    try:
        with pytest.raises(Stop), _signals_held():
            # to the other thread, as the kernel does when this one blocks it
            assert other.ident is not None
            signal.pthread_kill(other.ident, signal.SIGTERM)
            signal.pthread_kill(other.ident, signal.SIGTERM)  # a repeat is raised once
            deadline = time.monotonic() + 0.3
            while time.monotonic() < deadline:  # plenty of bytecode boundaries
                steps += 1
            assert raising_handlers == []  # not yet: the block finishes first
            finished = True
    finally:
        done.set()
        other.join()
    assert finished and steps > 0 and raising_handlers == [signal.SIGTERM]
    # the handlers in place before are back
    assert signal.getsignal(signal.SIGTERM) is not None
    with pytest.raises(Stop):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)


def test_nothing_arrives_nothing_is_raised(raising_handlers: list[int]) -> None:
    with _signals_held():
        pass
    assert raising_handlers == []
