"""Starting a node of a multi-node run: torchrun's rendezvous settings, waiting for the
store at ``--rdzv-endpoint``, and workers that do not outlive their launcher.

- :func:`rdzv_conf`: torchrun's ``--rdzv-conf`` (its join timeout, a short keep-alive so
  that :class:`~torchgpu.launch.nodes.NodeWatch` finds a lost node within seconds);
- :func:`await_store`: before torchrun starts, wait (interruptibly, up to
  ``--rdzv-timeout``) for a store to answer at an endpoint this node will not host, and
  name the endpoint in one paragraph when none does (exit 2) -- torch's agent would wait
  in an uninterruptible connect and end with a traceback;
- :func:`workers_die_with_launcher`: every worker gets SIGKILL when its launcher dies,
  so that a launcher killed on one node leaves no workers running there unsupervised
  (the other nodes then see the node lost).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

from torchgpu.errors import UsageError

#: How long a node waits for every node to arrive at the rendezvous (``--rdzv-timeout``);
#: torch's own default ``join_timeout``.
DEFAULT_RDZV_TIMEOUT_S = 600.0
#: The agents' keep-alive interval in the rendezvous (torch's default is 5 s), and how
#: many may be missed before a node counts as lost.
KEEP_ALIVE_S = 1
KEEP_ALIVE_MISSES = 3


def rdzv_conf(timeout_s: float) -> str:
    """torchrun's ``--rdzv-conf`` for a multi-node run: its own join timeout a little
    past ours (ours names what is missing), a keep-alive short enough to find a lost
    node within a few seconds."""
    return (f"join_timeout={int(timeout_s) + 30},keep_alive_interval={KEEP_ALIVE_S},"
            f"keep_alive_max_attempt={KEEP_ALIVE_MISSES}")


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host.strip("[]"), int(port)


def tcp_store(endpoint: str, timeout_s: float) -> Any:
    """A client of the store at ``endpoint``; raises when none answers in ``timeout_s``."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    host, port = split_endpoint(endpoint)
    return TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def _hosted_here(endpoint: str) -> bool:
    """Whether torch's agent on this node will host the store: the endpoint's address is
    one of this machine's and nothing listens on its port yet."""
    host, port = split_endpoint(endpoint)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def await_store(endpoint: str, timeout_s: float,
                stopped: Callable[[], signal.Signals | None]) -> signal.Signals | None:
    """Wait until a torch store answers at ``endpoint`` (skipped when this node will host
    it); returns the stop signal that ended the wait (``stopped()``), else None. Raises
    UsageError naming the endpoint when none answered within ``timeout_s``."""
    if _hosted_here(endpoint):
        return None
    deadline = time.monotonic() + timeout_s
    answered = threading.Event()
    host, port = split_endpoint(endpoint)

    def connect() -> None:
        # torch's client waits for the store's answer without a bound of its own (a port
        # where another program listens holds it forever): a daemon thread of its own,
        # given up at the deadline, so that the wait stays interruptible and bounded.
        with suppress(Exception):  # torch raises RuntimeError or its own
            tcp_store(endpoint, max(deadline - time.monotonic(), 1.0))
            answered.set()

    threading.Thread(target=connect, name="torchgpu-store-probe", daemon=True).start()
    listening = False
    while not answered.wait(0.2):
        sig = stopped()
        if sig is not None:
            return sig
        if time.monotonic() > deadline:
            break
        if not listening:
            with suppress(OSError), socket.create_connection((host, port), timeout=1):
                listening = True
    else:
        return None
    what = ("something listens there, but it does not answer as a torch store (another "
            "program's port?)" if listening else "nothing answered there")
    raise UsageError(
        f"--rdzv-endpoint {endpoint}: no torchrun rendezvous store answered within "
        f"{timeout_s:g} s (--rdzv-timeout): {what}. The endpoint must be an address of "
        "the first node (its launcher hosts the store) and a free port, the same on every "
        "node; start that node, or fix --rdzv-endpoint."
    )


_PR_SET_PDEATHSIG = 1


@contextmanager
def workers_die_with_launcher() -> Iterator[None]:
    """While the block runs, the processes torchrun's agent starts get SIGKILL when the
    launcher dies (Linux's parent-death signal); elsewhere nothing changes."""
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler as module,
        )
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        yield
        return
    popen = getattr(module, "Popen", None)
    if popen is None or not sys.platform.startswith("linux"):
        yield
        return
    parent = os.getpid()

    def die_with_parent() -> None:  # runs in the child between fork and exec
        if prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
        if os.getppid() != parent:  # the launcher died before the call above
            os._exit(128 + int(signal.SIGKILL))

    def started(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("preexec_fn", die_with_parent)
        return popen(*args, **kwargs)

    setattr(module, "Popen", started)  # noqa: B010  (not exported to the type checker)
    try:
        yield
    finally:
        setattr(module, "Popen", popen)  # noqa: B010



__all__ = ["DEFAULT_RDZV_TIMEOUT_S", "KEEP_ALIVE_MISSES", "KEEP_ALIVE_S", "await_store",
           "rdzv_conf", "split_endpoint", "tcp_store", "workers_die_with_launcher"]
