"""Heartbeats: where every rank is, so a hung collective is named instead of waited out.

A multi-process run started by :func:`torchgpu.launcher.run` gets a directory in
``TORCHGPU_HEARTBEAT_DIR``; each rank's :class:`Heartbeat` keeps one small JSON file
there (``rank<R>.json``, replaced atomically), written by a background thread about
four times a second from values the training loop already keeps (``state.step``), so
the loop itself does no extra work per step. A file holds:

- ``step`` (optimizer steps done), ``epoch``, ``phase`` (``setup``, ``training`` =
  forward/backward and the gradient all-reduce of step ``step + 1``, ``agreement`` =
  the stop/loss all-reduce, ``checkpoint`` = a checkpoint's collectives, ``evaluation``,
  ``finishing`` = the results gather and the closing barrier), ``progress_at`` (when
  the step last advanced), ``line`` (the last line the rank printed) and, once the
  rank has stalled for :data:`STALL_S`, ``stack`` (where its main thread is);
- ``failure``: what a rank records when one of its collectives failed (``kind``
  ``timeout`` or ``peer``, the phase and step, the error's first line).

The launcher's :class:`HangWatch` reads the files: when a rank records a timeout it
names the rank(s) that did not arrive, at which step and collective, where every other
rank was and each one's last line (:func:`diagnose`), ends every worker and keeps the
directory's NCCL flight-recorder dumps (``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``, set for
NCCL runs). Files only, in a directory on this node: no home-made transport; on several
nodes each node's launcher names the ranks of its own node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TextIO

HEARTBEAT_ENV = "TORCHGPU_HEARTBEAT_DIR"
TICK_S = 0.25  # how often a rank's file is rewritten (seconds)
STALL_S = 1.0  # no step for this long: the file also records the main thread's stack
#: What each phase is waiting on when a collective in it does not complete.
PHASES = {
    "setup": "the process group's setup (DDP's parameter broadcast)",
    "training": "the gradient all-reduce",
    "agreement": "the stop/loss agreement (an all-reduce)",
    "checkpoint": "a checkpoint's barrier (gather, then rank 0's write)",
    "evaluation": "the evaluation",
    "finishing": "the final results gather / closing barrier",
}
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


class _LastLine:
    """A text stream that remembers the last non-empty line written through it."""

    def __init__(self, stream: TextIO, beat: Heartbeat) -> None:
        self._stream = stream
        self._beat = beat

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        for part in reversed(re.split(r"[\r\n]", text)):
            if part.strip():
                self._beat.line = part.strip()[-300:]
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

    def __init__(self, directory: Path, rank: int, world_size: int) -> None:
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
        return cls(Path(directory), rank, world)

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

    def failed(self, kind: str, error: BaseException) -> None:
        """Record that a collective failed here (``kind``: timeout | peer)."""
        self._poll()
        text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())  # gloo's source location
        first = text.splitlines()[0] if text else type(error).__name__
        self._failure = {"kind": kind, "phase": self.phase, "step": self._step,
                         "error": first[-400:], "at": time.time(), "timeout_s": self.timeout_s}
        self.write()

    def where(self) -> str:
        """This rank's position in words (for its own error message)."""
        self._poll()
        return f"{PHASES.get(self.phase, self.phase)} of step {self._step + 1}" \
            if self.phase == "training" else \
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


def read_beats(directory: Path) -> dict[int, dict[str, Any]]:
    """Every rank's last heartbeat in ``directory`` (unreadable files are skipped)."""
    beats: dict[int, dict[str, Any]] = {}
    for path in sorted(directory.glob("rank*.json")):
        with suppress(OSError, ValueError):
            record = json.loads(path.read_text())
            if isinstance(record, dict) and isinstance(record.get("rank"), int):
                beats[record["rank"]] = record
    return beats


def _position(beat: dict[str, Any]) -> str:
    phase = str(beat.get("phase", "?"))
    step = int(beat.get("step", 0))
    if phase == "training":
        return f"in step {step + 1} (forward/backward, before or in its gradient all-reduce)"
    if phase == "done":
        return f"finished after step {step}"
    return f"in {PHASES.get(phase, phase)} after step {step}"


def diagnose(beats: dict[int, dict[str, Any]], dumps: list[Path] | None = None,
             aborted: frozenset[int] = frozenset(), now: float | None = None) -> str | None:
    """One paragraph naming the hang, or None when no rank recorded a timeout.

    Ranks that recorded a timeout waited in a collective; the ranks that recorded
    nothing did not arrive. ``aborted``: ranks NCCL's watchdog ended (SIGABRT) after a
    collective timeout, which records nothing from Python: they count as waiting where
    their heartbeat last was."""
    now = time.time() if now is None else now
    beats = dict(beats)
    for rank in aborted:
        beat = beats.get(rank)
        if beat is not None and not beat.get("failure"):
            beats[rank] = {**beat, "failure": {
                "kind": "timeout", "phase": beat.get("phase", "training"),
                "step": beat.get("step", 0), "at": beat.get("time", now),
                "error": "ended by NCCL's watchdog after the collective timeout"}}
    waiting = {r: b for r, b in beats.items() if (b.get("failure") or {}).get("kind") == "timeout"}
    if not waiting:
        return None
    first = min(waiting.values(), key=lambda b: float(b["failure"].get("at", now)))
    failure = first["failure"]
    phase, step = str(failure.get("phase", "training")), int(failure.get("step", 0))
    collective = PHASES.get(phase, phase)
    where = f"{collective} of step {step + 1}" if phase == "training" else \
        f"{collective} after step {step}"
    world = int(first.get("world_size", len(beats)))
    missing = [r for r in range(world) if r not in waiting]
    timeout_s = failure.get("timeout_s")
    waited = f" for {float(timeout_s):g} s" if timeout_s else ""
    head = (f"torchgpu: the run hung: rank(s) {', '.join(map(str, sorted(waiting)))} waited"
            f"{waited} in {where}, which rank(s) "
            f"{', '.join(map(str, missing)) or '(none recorded)'} did not reach")
    places = []
    for rank in range(world):
        beat = beats.get(rank)
        if beat is None:
            places.append(f"rank {rank}: no heartbeat (not started, or on another node)")
            continue
        if rank in waiting:
            error = beat["failure"].get("error", "")
            text = f"rank {rank}: waiting in {where} (timed out: {error})"
        else:
            stalled = now - float(beat.get("progress_at", now))
            text = f"rank {rank}: {_position(beat)}, no step for {stalled:.1f} s"
            if beat.get("stack"):
                text += f", at {' <- '.join(beat['stack'])}"
        line = str(beat.get("line") or "").strip()[-160:]
        places.append(text + (f"; last line: {line!r}" if line else "; printed nothing"))
    tail = ""
    if dumps:
        tail = (f" NCCL flight-recorder dumps: {', '.join(str(d) for d in dumps)} (read them "
                f"with: python -m torch.distributed.flight_recorder.fr_trace "
                f"{dumps[0].parent} --prefix {FLIGHT_RECORDER_PREFIX}).")
    return (f"{head}. Where each rank was: {'; '.join(places)}. Every worker was "
            f"stopped.{tail} Look at what the missing rank(s) do at that point (a stuck "
            "data loader, a rank-dependent branch that skips a collective, a deadlock); if "
            "a step legitimately takes longer, raise --collective-timeout.")


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


class HangWatch:
    """The launcher's side: a heartbeat directory for the workers, watched for hangs.

    :meth:`installed` creates the directory, exports it (and, with ``flight_recorder``,
    NCCL's flight-recorder settings) to the workers through the environment and polls
    it; when a rank records a collective timeout it waits up to ``settle_s`` for the
    other ranks to record theirs (or exit), writes :attr:`report` (:func:`diagnose`),
    calls ``stop_workers`` (which must end every worker) and moves the flight-recorder
    dumps to ``out_dir`` (when given). The directory is removed on exit.
    """

    def __init__(self, stop_workers: Callable[[], None], out_dir: Path | None = None,
                 flight_recorder: bool = False, settle_s: float = 1.5,
                 poll_s: float = TICK_S) -> None:
        self.stop_workers = stop_workers
        self.out_dir = out_dir
        self.flight_recorder = flight_recorder
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.report: str | None = None
        self.directory: Path | None = None
        self._done = threading.Event()

    @contextmanager
    def installed(self) -> Iterator[HangWatch]:
        directory = Path(tempfile.mkdtemp(prefix="torchgpu-heartbeat-"))
        self.directory = directory
        wanted = {HEARTBEAT_ENV: str(directory)}
        recorder = (*FLIGHT_RECORDER_ENV,
                    (*FLIGHT_RECORDER_FILE_ENV, str(directory / FLIGHT_RECORDER_PREFIX)))
        for name, older, value in recorder if self.flight_recorder else ():
            if not os.environ.get(name) and not os.environ.get(older):
                wanted[name] = value
        saved = {name: os.environ.get(name) for name in wanted}
        os.environ.update(wanted)
        thread = threading.Thread(target=self._watch, name="torchgpu-hangwatch", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._done.set()
            thread.join(timeout=5)
            for name, old in saved.items():
                if old is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = old
            shutil.rmtree(directory, ignore_errors=True)

    def _watch(self) -> None:
        assert self.directory is not None
        while not self._done.wait(self.poll_s):
            beats = read_beats(self.directory)
            if not any((b.get("failure") or {}).get("kind") == "timeout" for b in beats.values()):
                continue
            deadline = time.monotonic() + self.settle_s
            while time.monotonic() < deadline and not self._done.is_set():
                beats = read_beats(self.directory)
                if all(b.get("failure") or not _alive(b.get("pid")) for b in beats.values()):
                    break
                time.sleep(0.1)
            dumps = self.keep_dumps()
            self.report = diagnose(beats, dumps=dumps)
            self.stop_workers()
            return

    def after_failure(self, aborted: frozenset[int]) -> str | None:
        """The hang paragraph after torchrun reported failed workers: for ranks NCCL's
        watchdog ended (``aborted``, SIGABRT), which the watcher could not see coming;
        None when the heartbeats show no hang."""
        if self.directory is None or not aborted:
            return None
        beats = read_beats(self.directory)
        return diagnose(beats, dumps=self.keep_dumps(), aborted=aborted) if beats else None

    def keep_dumps(self) -> list[Path]:
        """The NCCL flight-recorder dumps, moved to ``out_dir/flight_recorder`` when an
        output directory is known (else they would go with the heartbeat directory)."""
        assert self.directory is not None
        found = sorted(self.directory.glob(f"{FLIGHT_RECORDER_PREFIX}*"))
        if not found or self.out_dir is None:
            return found
        target = self.out_dir / "flight_recorder"
        kept: list[Path] = []
        for path in found:
            with suppress(OSError):
                target.mkdir(parents=True, exist_ok=True)
                kept.append(Path(shutil.move(str(path), target / path.name)))
        return kept


def kill_children(children: Callable[[], list[int]]) -> Callable[[], None]:
    """A ``stop_workers`` for :class:`HangWatch`: SIGKILL every child's process group."""
    def stop() -> None:
        for pid in children():
            with suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
    return stop
