"""Several nodes: the rendezvous and the other nodes of a run, each failure named in time.

A :class:`NodeWatch` (one per launcher of a multi-node run, a thread) reads the state
torchrun's c10d rendezvous keeps in the store at ``--rdzv-endpoint`` (the node agents and
their keep-alives) and turns what torchrun would wait out silently into one paragraph:

- at the rendezvous: another ``--nnodes`` on some node is a UsageError on every node;
  nodes missing after ``--rdzv-timeout`` are a :class:`NodesMissingError`; SIGTERM/SIGINT
  ends the wait at once. These reach the main thread through ``SIGUSR1``, which
  interrupts torch's rendezvous loop;
- while the workers run: a node whose agent stopped keeping alive or whose store stopped
  answering is *lost*: this node's workers are ended at once (their collectives would
  wait for ``--collective-timeout``) and :attr:`NodeWatch.lost` names it with the step.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import FrameType
from typing import Any

from torchgpu.errors import TorchGpuError, UsageError
from torchgpu.launch.rendezvous import KEEP_ALIVE_MISSES, KEEP_ALIVE_S, tcp_store

#: How often the watch reads the rendezvous: a lost node is named within about
#: KEEP_ALIVE_S * KEEP_ALIVE_MISSES + POLL_S seconds.
POLL_S = 0.5
#: How long one store request of the watch may take before the store counts as gone.
STORE_TIMEOUT_S = 5.0
#: After this node's workers failed, how long its launcher waits at most for the other
#: nodes' word (their workers ended, every node's word read) before it exits, with the
#: store when it hosts it: so that none takes its exit for a loss.
LINGER_S = 2.0
_WAKE = signal.SIGUSR1


class NodesMissingError(TorchGpuError, RuntimeError):
    """Not every node arrived at the rendezvous within ``--rdzv-timeout``."""


def _describe(node: Any, rank: int | None) -> str:
    where = f"{getattr(node, 'addr', '?')}, launcher pid {getattr(node, 'pid', '?')}"
    return f"node {rank} ({where})" if rank is not None else f"the node at {where}"


class NodeLostError(TorchGpuError, RuntimeError):
    """A node was lost (its paragraph is printed when it is found)."""


class NodeWatch:
    """Watches the rendezvous and the other nodes of one multi-node launcher (see the
    module docstring). ``stop_workers`` ends this node's workers; ``end_on_loss``: end
    them when a node is lost (False for torchgpu's own workers, which stop by themselves:
    with a checkpoint when the lost node's workers stop too, else when their collective
    fails or times out); ``steps`` gives the steps this node's ranks had done (empty when
    unknown); ``before_exit`` tidies up before the launcher exits at once because a node
    was lost while torch's agent waited for it in its exit barrier (up to 300 s, in a
    call nothing interrupts)."""

    def __init__(self, endpoint: str, run_id: str, nnodes: int, timeout_s: float,
                 stop_workers: Callable[[], None], end_on_loss: bool = True,
                 steps: Callable[[], list[int]] = list,
                 pending_stop: Callable[[], signal.Signals | None] = lambda: None,
                 before_exit: Callable[[], None] = lambda: None) -> None:
        self.endpoint, self.run_id, self.nnodes = endpoint, run_id, nnodes
        self.timeout_s = timeout_s
        self.stop_workers, self.steps = stop_workers, steps
        self.end_on_loss, self.before_exit = end_on_loss, before_exit
        self.pending_stop = pending_stop  # a stop signal the launcher got before
        self.error: TorchGpuError | None = None  # ends the rendezvous, then the run
        self.lost: str | None = None  # the paragraph naming a lost node
        self.stopped: signal.Signals | None = None  # a stop signal at the rendezvous
        # reentrant: the SIGUSR1 handler takes it in the main thread, which may hold it
        self._lock = threading.RLock()
        self._in_rendezvous = False
        self._deadline = time.monotonic() + timeout_s
        self._me: Any = None
        self._round: dict[Any, int] | None = None  # the running round's participants
        self._arrived = (0, 0)  # (participants, waiting) last seen at the rendezvous
        self._store: Any = None
        self._backend: Any = None  # torch's reader of the rendezvous state in the store
        self._handler: Any = None  # torch's rendezvous handler
        self._done = threading.Event()
        self._main = threading.main_thread().ident
        self._succeeded = False  # this node's workers finished: peers may exit now
        self._round_no = -1  # torch's number of the running round
        self._peer_ended = False  # another node's workers ended by themselves this round
        self._checked = False  # the nodes' --nnodes compared since this round began
        self._failed = False  # this node's workers failed: is a peer's exit its own?

    @contextmanager
    def installed(self) -> Iterator[NodeWatch]:
        """Watch while the block runs (main thread: SIGUSR1 then raises :attr:`error`)."""
        previous = signal.signal(_WAKE, self._wake)
        thread = threading.Thread(target=self._watch, name="torchgpu-nodes", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._linger()
            self._done.set()
            thread.join(timeout=STORE_TIMEOUT_S + 1)
            signal.signal(_WAKE, previous)

    def _linger(self) -> None:
        """After this node's workers failed: wait (at most LINGER_S) until every other node
        of the round recorded that its workers ended and that it read every node's word
        (so no node reads a store host's exit as a loss), or the store is gone."""
        peers = [node for node in self._round or {} if node != self._me]
        deadline, told = time.monotonic() + LINGER_S, False
        while self._failed and peers and self.lost is None and time.monotonic() < deadline:
            try:
                if not told and all([self._ended(node) for node in peers]):
                    self._store.set(self._key("seen", self._me), str(self._round_no))
                    told = True
                if told and all(self._marked(self._key("seen", node)) for node in peers):
                    return
            except Exception:  # the store is gone: nobody is left to tell
                return
            time.sleep(POLL_S / 10)

    @contextmanager
    def rendezvous(self, handler: Any) -> Iterator[None]:
        """Around one rendezvous of torch's agent (``handler``: its rendezvous handler):
        a stop signal, a mismatch or the timeout ends it with an exception."""
        from torch.distributed.elastic.multiprocessing.api import SignalException

        from torchgpu.stop_signals import routed_to

        def stop(signum: int, frame: FrameType | None) -> None:
            self.stopped = signal.Signals(signum)
            raise SignalException(f"{self.stopped.name} at the rendezvous", self.stopped)

        with self._lock:
            self._handler = handler  # with it the store it may host, until this watch ends
            self._me = getattr(handler, "_this_node", None)
            self._in_rendezvous, self._round, self._peer_ended = True, None, False
            self._checked = False
            self._deadline = time.monotonic() + self.timeout_s
            if self.error is not None:
                raise self.error
        early = self.pending_stop()
        if early is not None:  # came while torch's agent connected to the store
            self.stopped = early
            raise SignalException(f"{early.name} at the rendezvous", early)
        try:
            with routed_to(stop):
                yield
            state = getattr(getattr(handler, "_state_holder", None), "state", None)
            self._round_no = int(getattr(state, "round", self._round_no))
        finally:
            with self._lock:
                self._in_rendezvous = False

    def rendezvous_failed(self, error: Exception) -> int:
        """The exit code for torch's rendezvous ``error`` (a RendezvousError), after its
        paragraph; raises this watch's own error when it has one."""
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousClosedError,
            RendezvousConnectionError,
        )

        if self.error is not None:
            raise self.error from None
        if self.lost is not None:
            return 1
        if isinstance(error, RendezvousConnectionError):
            raise UsageError(
                f"--rdzv-endpoint {self.endpoint}: torchrun's agent could not reach the "
                f"rendezvous store there ({error.__cause__ or error}). The endpoint must be "
                "an address of the first node (its launcher hosts the store) and a free "
                "port, the same on every node."
            ) from None
        why = ("another node's launcher closed it (it exited: its workers finished or "
               "failed, or it was stopped)" if isinstance(error, RendezvousClosedError)
               else str(error).splitlines()[0] if str(error) else type(error).__name__)
        print(f"torchgpu: the rendezvous at {self.endpoint} (job {self.run_id!r}) ended: "
              f"{why}. Start the job again on every node.", file=sys.stderr, flush=True)
        return 1

    def _wake(self, signum: int, frame: FrameType | None) -> None:
        with self._lock:
            error = self.error if self._in_rendezvous else None
        if error is not None:
            raise error

    def workers_ended(self, succeeded: bool) -> None:
        """This node's workers of the round ended (torch's agent saw it): recorded in the
        store at once, before the agent closes the rendezvous and exits, so that the
        other nodes do not take this node's exit for a loss."""
        self._succeeded, self._failed = succeeded, not succeeded
        if self._store is not None and self._me is not None:
            with suppress(Exception):  # the store may be gone: then nothing is to be told
                self._store.set(self._key("ended", self._me), str(self._round_no))
        if succeeded and self.lost is not None:  # not to wait for it in the exit barrier
            raise NodeLostError(self.lost)

    def _key(self, what: str, node: Any) -> str:
        return f"torchgpu.{what}.{self.run_id}.{node!r}"

    def _marked(self, key: str) -> bool:
        """Whether ``key`` was recorded in this round."""
        return bool(self._store.check([key])
                    and self._store.get(key).decode() == str(self._round_no))

    def _ended(self, node: Any) -> bool:
        """Whether ``node``'s workers of this round ended by themselves (not lost)."""
        ended = self._marked(self._key("ended", node))
        self._peer_ended = self._peer_ended or ended
        return ended

    def wait_lost(self) -> str | None:
        """After this node's workers failed: the paragraph naming a node lost meanwhile
        (a peer's death fails the workers at once, its keep-alive expires a little
        later), or None when every node still keeps alive or one closed the rendezvous."""
        # a lost store host is seen when a request fails, after up to STORE_TIMEOUT_S
        deadline = (time.monotonic() + max(KEEP_ALIVE_S * KEEP_ALIVE_MISSES, STORE_TIMEOUT_S)
                    + 2 * POLL_S)
        while (self.lost is None and self._round is not None and not self._peer_ended
               and time.monotonic() < deadline):
            time.sleep(POLL_S / 2)
        return self.lost

    def _watch(self) -> None:
        # after this node's workers failed, look often: a peer whose workers failed too
        # records so just before its launcher exits, with the store when it hosts it
        while not self._done.wait(POLL_S / 10 if self._failed else POLL_S):
            try:
                if self._look():
                    return
            except TorchGpuError as error:
                self._fail(error)
                return

    def _look(self) -> bool:
        """One look at the store; True when the watch is over. Raises what ends the run."""
        try:
            if self._store is None:
                self._store = tcp_store(self.endpoint, STORE_TIMEOUT_S)
                self._publish()
            if self._in_rendezvous or not self._checked:  # once more after it completed
                self._checked = not self._in_rendezvous
                self._check_nnodes()
            state = self._state()
        except TorchGpuError:
            raise
        except Exception:  # the store is not up yet, or it went away
            if self._round is not None and self._succeeded:
                return True  # its host exited after the exit barrier, or was lost in it
            if self._round is not None and not self._peer_ended:
                self._lose(None, None, f"the rendezvous store at {self.endpoint}, which "
                           "its launcher hosts, stopped answering (killed, or its machine "
                           "or network gone" + ("; or it exited after its workers failed: "
                                                "see its output)" if self._failed else ")"))
                return True
            self._check_deadline()
            return False
        if self._in_rendezvous:
            if state is not None:
                self._arrived = (len(state.participants), len(state.wait_list))
            self._check_deadline()
            return False
        return state is not None and self._watch_round(state)

    def _publish(self) -> None:
        """Record this node's ``--nnodes`` under the next free index of this job."""
        index = int(self._store.add(f"torchgpu.nodes.{self.run_id}", 1))
        record = {"nnodes": self.nnodes, "host": socket.gethostname(), "pid": os.getpid()}
        self._store.set(f"torchgpu.node.{self.run_id}.{index}", json.dumps(record))

    def _check_nnodes(self) -> None:
        count = int(self._store.add(f"torchgpu.nodes.{self.run_id}", 0))
        for index in range(1, count + 1):
            key = f"torchgpu.node.{self.run_id}.{index}"
            if not self._store.check([key]):
                continue
            other = json.loads(self._store.get(key))
            if int(other.get("nnodes", self.nnodes)) != self.nnodes:
                raise UsageError(
                    f"--nnodes disagrees between the nodes of job {self.run_id!r} at "
                    f"{self.endpoint}: this node gives --nnodes {self.nnodes}, the node on "
                    f"{other.get('host')} (launcher pid {other.get('pid')}) gives --nnodes "
                    f"{other['nnodes']}. Give every node the same --nnodes (and the same "
                    "--rdzv-endpoint and --rdzv-id), then start them again."
                )

    def _state(self) -> Any:
        """torch's rendezvous state as its c10d backend keeps it (None: not yet made)."""
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )

        if self._backend is None:
            self._backend = C10dRendezvousBackend(self._store, self.run_id)
        got = self._backend.get_state()
        return None if got is None else pickle.loads(got[0])  # torch's own state

    def _check_deadline(self) -> None:
        with self._lock:
            late = self._in_rendezvous and time.monotonic() > self._deadline
        if not late:
            return
        joined, waiting = self._arrived
        arrived = joined + waiting
        raise (NodesMissingError(
            f"only {arrived} of {self.nnodes} nodes arrived at the rendezvous at "
            f"{self.endpoint} (job {self.run_id!r}) within {self.timeout_s:g} s "
            f"(--rdzv-timeout): {self.nnodes - arrived} missing. Start the missing node(s) "
            "with the same --nnodes, --rdzv-endpoint and --rdzv-id (check that they reach "
            "this endpoint), or raise --rdzv-timeout if they start later."
            if arrived else
            f"no node completed the rendezvous at {self.endpoint} (job {self.run_id!r}) "
            f"within {self.timeout_s:g} s (--rdzv-timeout), of the {self.nnodes} expected."
        ))

    def _watch_round(self, state: Any) -> bool:
        """One look at a running round; True when the watch is over (a node lost)."""
        if self._round is None:
            if getattr(state, "complete", False):
                self._round, self._round_no = dict(state.participants), int(state.round)
            return False
        now = datetime.now(timezone.utc)
        stale = timedelta(seconds=KEEP_ALIVE_S * KEEP_ALIVE_MISSES)
        peers = sorted(((node, rank) for node, rank in self._round.items()
                        if node != self._me and (self._me is not None
                                                 or getattr(node, "pid", 0) != os.getpid())),
                       key=lambda item: item[1])
        if self._failed:  # read before a store host's exit takes the store with it
            for node, _ in peers:
                self._ended(node)
        for node, rank in peers:
            beat = state.last_heartbeats.get(node)
            gone = node not in state.participants or beat is None or now - beat > stale
            if gone and not self._ended(node):  # an agent that exited by itself is no loss
                self._lose(node, rank, "its launcher stopped keeping alive in the rendezvous "
                           f"(none for over {stale.total_seconds():g} s: killed, or its "
                           "machine or network gone)")
                return True
        return False

    def _lose(self, node: Any, rank: int | None, why: str) -> None:
        steps = self.steps()
        at = f" after step {max(steps)}" if steps else ""
        of = f" of {len(self._round)}" if self._round else ""
        who = (_describe(node, rank) + of if node is not None else
               f"the node hosting the rendezvous (one{of or ' of the nodes'})")
        if self._succeeded:
            then = "This node's workers had ended (finished, or stopped with the lost node's)"
        elif self.end_on_loss:
            then = ("This node's workers were ended, not left to wait for it until their "
                    "collectives time out")
        else:
            then = ("This node's workers stop with a checkpoint if the lost node's workers "
                    "stop too, else when their collectives fail or time out "
                    "(--collective-timeout)")
        self.lost = (
            f"torchgpu: {who} was lost{at}: {why}. {then}; the run is not finished. "
            "Restart the job on every node (a run with --save-every continues from its "
            "newest checkpoint with --autoresume)."
        )
        print(self.lost, file=sys.stderr, flush=True)
        if self.end_on_loss:
            self.stop_workers()
        if self._succeeded:  # the agent waits for the lost node in its exit barrier
            self.before_exit()
            os._exit(1)

    def _fail(self, error: TorchGpuError) -> None:
        with self._lock:
            self.error = error
            waking = self._in_rendezvous
        if waking and self._main is not None:
            signal.pthread_kill(self._main, _WAKE)
        elif not waking:
            self.stop_workers()


def heartbeat_steps(directory: Path | None) -> list[int]:
    """The steps this node's ranks recorded in their heartbeats (none: unknown)."""
    if directory is None:
        return []
    from torchgpu.launch.hang_watch import read_beats

    return [int(beat.get("step", 0)) for beat in read_beats(directory).values()]


__all__ = ["NodeLostError", "NodeWatch", "NodesMissingError", "heartbeat_steps"]
