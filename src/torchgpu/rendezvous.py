"""Waiting for the peers that form a process group, and leaving that wait when a stop
comes: :func:`form_watching` runs torch's rendezvous (which cannot be interrupted) in a
thread and raises :class:`GroupStopped` when ``stop()`` answers True first;
:func:`await_peers` waits on the store until every rank of a formation has arrived, or
raises a timeout naming how many came."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from torchgpu.errors import DistributedError

#: How often a stop is looked for while the process group forms (seconds).
_STOP_POLL_S = 0.05
#: After a stop is seen, how long a group that is forming may still take to form: the
#: peers may have formed it already, and then every rank must take part in the stop.
_STOP_GRACE_S = 0.5



class GroupStopped(Exception):
    """A stop was requested while this process waited for its peers to form the process
    group (:func:`init_distributed` with ``stop``): no group exists, nothing ran."""


_formed = [0]  # groups this process has formed: each meets its peers under its own key


def await_peers(store: dist.distributed_c10d.Store, world: int, timeout: timedelta, *,
                began: float | None = None) -> None:
    """Wait until ``world`` ranks have arrived on ``store`` for this formation (every rank
    forms its groups in the same order, so the n-th formation's key is the same on each),
    or raise a timeout naming how many came within ``timeout``, counted from ``began``
    (a ``time.monotonic()`` reading, e.g. before connecting to the store: the whole
    start-up wait is then ``timeout``) or from now."""
    _formed[0] += 1
    key = f"torchgpu/joined/{_formed[0]}"
    arrived = store.add(key, 1)
    start = time.monotonic() if began is None else began
    deadline = start + timeout.total_seconds()
    while arrived < world:
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"timed out waiting {int(timeout.total_seconds() * 1000)} ms for the other "
                f"ranks to form the process group: {arrived} of {world} arrived")
        time.sleep(0.02)
        arrived = store.add(key, 0)


def form_watching(form: Callable[[], None], stop: Callable[[], bool] | None) -> None:
    """``form()`` (which blocks until every peer has joined); with ``stop``, in a thread
    while this one polls ``stop`` and raises :class:`GroupStopped` when it answers True
    before ``form`` returned (allowing :data:`_STOP_GRACE_S` for a group that is
    forming at that moment). torch's rendezvous cannot be interrupted: a thread is how
    the wait is left."""
    if stop is None:
        form()
        return
    if stop():
        raise GroupStopped
    failure: list[BaseException] = []

    def run() -> None:
        try:
            form()
        except BaseException as error:  # handed to the waiting thread
            failure.append(error)

    worker = threading.Thread(target=run, name="torchgpu-form-group", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(_STOP_POLL_S)
        if worker.is_alive() and stop():
            worker.join(_STOP_GRACE_S)
            if worker.is_alive():
                raise GroupStopped
    if failure:
        raise failure[0]
