"""Heartbeats: where every rank is, so a hung collective is named instead of waited out.

A multi-process run started by :func:`torchgpu.launch.run.run` gets a directory in
``TORCHGPU_HEARTBEAT_DIR``; each rank's :class:`Heartbeat` keeps one small JSON file
there (``rank<R>.json``, replaced atomically), written by a background thread about
four times a second from values the training loop already keeps (``state.step``), so
the loop itself does no extra work per step. A file holds:

- ``step`` (optimizer steps done), ``epoch``, ``phase`` (``startup`` = building the
  model and loading the data, ``joining`` = forming the process group, ``setup``,
  ``data`` = waiting for the next batch from the data loader, ``training`` =
  forward/backward and the gradient all-reduce of step ``step + 1``, ``stages`` = the
  same for the multi-process stage pipeline, whose step waits on the stages' sends and
  receives, ``agreement`` =
  the stop/loss all-reduce, ``checkpoint`` = a checkpoint's collectives, ``evaluation``,
  ``finishing`` = the results gather and the closing barrier), ``progress_at`` (when
  the step last advanced), ``line`` (the last line the rank printed) and, once the
  rank has stalled for :data:`STALL_S`, ``stack`` (where its main thread is);
- ``failure``: what a rank records when one of its collectives failed (``kind``
  ``timeout`` or ``peer``, the phase and step, the error's first line).

The launcher's :class:`~torchgpu.launch.hang_watch.HangWatch` reads the files and names
the hang. A rank whose collective timed out waits briefly for it to end every worker
(:meth:`Heartbeat.failed`), so that its paragraph is the run's last word. Files only, in
a directory on this node: no home-made transport.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

HEARTBEAT_ENV = "TORCHGPU_HEARTBEAT_DIR"
TICK_S = 0.25  # how often a rank's file is rewritten (seconds)
STALL_S = 1.0  # no step for this long: the file also records the main thread's stack
#: A file older than this was not rewritten by its thread: the whole process stopped
#: running (SIGSTOP, a frozen node, swapping), so what it says is only its last known place.
STALE_S = 8 * TICK_S
#: How long a rank whose collective timed out waits for the launcher to end every worker
#: (its watcher polls every TICK_S and settles for at most 1.5 s) before it exits on its
#: own with its error.
AWAIT_KILL_S = 10.0
#: What each phase is waiting on when a collective in it does not complete.
PHASES = {
    "startup": "its start-up (building the model, loading the data)",
    "joining": "forming the process group (start-up)",
    "setup": "the process group's setup (DDP's parameter broadcast)",
    "data": "data loading (the next batch, before its forward/backward)",
    "training": "the gradient all-reduce",
    "stages": "the stages' sends and receives",  # the multi-process stage pipeline's step
    "agreement": "the stop/loss agreement (an all-reduce)",
    "checkpoint": "a checkpoint's barrier (gather, then rank 0's write)",
    "evaluation": "the evaluation",
    "finishing": "the final results gather / closing barrier",
}
#: Phases of a step in progress: a collective failing there is "of step N + 1".
STEP_PHASES = ("training", "stages", "data")
#: Phases before the process group exists: a timeout there is the start-up's.
STARTUP_PHASES = ("startup", "joining")
#: Flight-recorder settings for NCCL runs: (current name, older name, value); set only
#: where the user set neither (torch >= 2.9 reads the TORCH_FR_* names and warns on the
#: older ones).
FLIGHT_RECORDER_ENV = (
    ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
)
FLIGHT_RECORDER_FILE_ENV = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
FLIGHT_RECORDER_PREFIX = "nccl_flight_recorder_rank_"
# gloo: "Timed out waiting 3000ms for recv operation to complete"; NCCL's watchdog:
# "Watchdog caught collective operation timeout"; DistError subclasses name a timeout too.
_TIMEOUT = re.compile(r"timed out waiting \d+ ?ms|collective operation timeout", re.IGNORECASE)
_TIMEOUT_WORD = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER = re.compile(r"connection (closed|reset)|broken pipe|econnreset|closed by peer",
                   re.IGNORECASE)
_BACKEND = re.compile(r"gloo|nccl|processgroup|c10d", re.IGNORECASE)


def collective_failure(error: BaseException) -> str | None:
    """``"timeout"`` when ``error`` is a collective that did not complete in time,
    ``"peer"`` when a peer went away under it, else None (not a collective's error: a
    DataLoader's own timeout, say, stays what it is)."""
    import torch.distributed as dist

    text = str(error)
    dist_error = isinstance(error, getattr(dist, "DistError", ()))
    if _TIMEOUT.search(text) or (dist_error and _TIMEOUT_WORD.search(text)):
        return "timeout"
    if (dist_error or _BACKEND.search(text)) and _PEER.search(text):
        return "peer"
    return None


def clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters at its end (its start is what names it)."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _LastLine:
    """A text stream that remembers the last non-empty line written through it."""

    def __init__(self, stream: TextIO, beat: Heartbeat) -> None:
        self._stream = stream
        self._beat = beat

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        for part in reversed(re.split(r"[\r\n]", text)):
            if part.strip():
                self._beat.line = clip(part.strip(), 300)
                break
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class Heartbeat:
    """This rank's heartbeat file in ``directory`` (see the module docstring).

    :meth:`running` starts the writer thread (and records printed lines); :meth:`follow`
    points it at the run's TrainState; :meth:`during` marks a phase; :meth:`failed`
    records a collective's failure. Every write is best-effort: a full disk never
    stops training.
    """

    def __init__(self, directory: Path, rank: int, world_size: int,
                 await_kill_s: float = 0.0) -> None:
        self.path = directory / f"rank{rank}.json"
        self.rank = rank
        self.world_size = world_size
        self.phase = "setup"
        self.line = ""
        self.timeout_s: float | None = None  # the run's collective timeout, for the message
        self._state: Any = None
        self._step = 0
        self._epoch = 0
        self._progress_at = time.time()
        self._failure: dict[str, Any] | None = None
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._main = threading.main_thread().ident
        self._parent = os.getppid()  # the launcher; a new parent means it died
        self.orphaned = False
        self.await_kill_s = await_kill_s  # see failed()

    @classmethod
    def from_env(cls) -> Heartbeat | None:
        """The heartbeat the launcher asked for (``TORCHGPU_HEARTBEAT_DIR``, RANK and
        WORLD_SIZE set, more than one process), else None."""
        directory = os.environ.get(HEARTBEAT_ENV, "")
        try:
            rank = int(os.environ.get("RANK", ""))
            world = int(os.environ.get("WORLD_SIZE", ""))
        except ValueError:
            return None
        if not directory or world < 2 or not Path(directory).is_dir():
            return None
        return cls(Path(directory), rank, world, await_kill_s=AWAIT_KILL_S)

    def follow(self, state: Any) -> None:
        """Report ``state.step`` / ``state.epoch`` (read by the writer thread)."""
        self._state = state

    @contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """Mark ``phase`` while the block runs (then back to the phase before)."""
        before, self.phase = self.phase, phase
        self.write()
        yield  # an error leaves the phase where it happened, for failed()
        self.phase = before

    def loading(self, batches: Iterable[T]) -> Iterator[T]:
        """``batches``, with the phase ``data`` while the next one is awaited (a slow or
        stuck data loader is then named as such), and the phase before it meanwhile."""
        iterator = iter(batches)
        while True:
            before, self.phase = self.phase, "data"
            try:
                item = next(iterator)
            except StopIteration:
                return
            finally:
                self.phase = before
            yield item

    def failed(self, kind: str, error: BaseException) -> None:
        """Record that a collective failed here (``kind``: timeout | peer).

        A timeout then waits up to ``await_kill_s`` (:data:`AWAIT_KILL_S` under the
        launcher) for the launcher's :class:`HangWatch` to end every worker at once and
        print the one paragraph that names the hang: a rank that exited first would
        print its own error and set off torchrun's teardown of the others (SIGTERM,
        whose side effects -- a DataLoader worker's death, say -- print tracebacks)
        before that paragraph. Not ended in time (no watcher, or the launcher is gone),
        it returns and the rank fails with its own error as before."""
        self._poll()
        text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())  # gloo's source location
        first = text.splitlines()[0] if text else type(error).__name__
        self._failure = {"kind": kind, "phase": self.phase, "step": self._step,
                         "error": first[-400:], "at": time.time(), "timeout_s": self.timeout_s}
        self.write()
        if kind != "timeout":
            return
        deadline = time.monotonic() + self.await_kill_s
        while time.monotonic() < deadline and not self.orphaned \
                and os.getppid() == self._parent:
            time.sleep(0.05)

    def where(self) -> str:
        """This rank's position in words (for its own error message)."""
        self._poll()
        return f"{PHASES.get(self.phase, self.phase)} of step {self._step + 1}" \
            if self.phase in STEP_PHASES else \
            f"{PHASES.get(self.phase, self.phase)} after step {self._step}"

    @contextmanager
    def running(self) -> Iterator[Heartbeat]:
        """Write the file now and every TICK_S until the block ends; remember printed lines."""
        streams = sys.stdout, sys.stderr
        sys.stdout = _LastLine(sys.stdout, self)
        sys.stderr = _LastLine(sys.stderr, self)
        thread = threading.Thread(target=self._tick, name="torchgpu-heartbeat", daemon=True)
        self.write()
        thread.start()
        try:
            yield self
        finally:
            self._done.set()
            thread.join(timeout=2)
            if self._failure is None:
                self.phase = "done"
                self.write()
            sys.stdout, sys.stderr = streams

    def _poll(self) -> None:
        state = self._state
        if state is None:
            return
        step, epoch = int(state.step), int(state.epoch)
        if step != self._step:
            self._progress_at = time.time()
        self._step, self._epoch = step, epoch

    def _tick(self) -> None:
        while not self._done.wait(TICK_S):
            self.write()
            if not self.orphaned and os.getppid() != self._parent:
                self._orphaned()

    def _orphaned(self) -> None:
        """The launcher died without ending this worker (SIGKILL runs no handler): stop as
        on SIGTERM -- at the next step boundary every rank agrees on, with a checkpoint
        when saving -- instead of training on unseen; the launcher's heartbeat directory
        goes with the last rank."""
        with self._lock:
            self.orphaned = True
        print(f"torchgpu: the launcher (pid {self._parent}) is gone: rank {self.rank} stops "
              "at the next step boundary, as on SIGTERM.", file=sys.stderr, flush=True)
        with suppress(OSError):
            self.path.unlink()
        with suppress(OSError):
            self.path.parent.rmdir()  # the last rank's removal empties it
        os.kill(os.getpid(), signal.SIGTERM)

    def _stack(self) -> list[str]:
        frame = sys._current_frames().get(self._main or 0)
        if frame is None:
            return []
        frames = [f for f in traceback.extract_stack(frame) if f.filename != __file__][-4:]
        return [f"{Path(f.filename).name}:{f.lineno} in {f.name}" for f in reversed(frames)]

    def write(self) -> None:
        """Replace the file with the current values (best-effort; none once orphaned)."""
        with self._lock:
            if self.orphaned:
                return
            self._poll()
            now = time.time()
            record = {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                      "step": self._step, "epoch": self._epoch, "phase": self.phase,
                      "progress_at": self._progress_at, "time": now, "line": self.line,
                      "failure": self._failure,
                      "stack": self._stack() if now - self._progress_at > STALL_S else []}
            temporary = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            with suppress(OSError):
                temporary.write_text(json.dumps(record))
                os.replace(temporary, self.path)
