"""The launcher's side of the heartbeats: a hung collective named in one paragraph.

:class:`HangWatch` gives the workers a heartbeat directory (:mod:`torchgpu.launch.heartbeat`
writes one file per rank there) and polls it. When a rank records a collective timeout
it waits briefly for the other ranks to record theirs, names the rank(s) that did not
arrive, the step and collective, where every rank was and each one's last line
(:func:`diagnose`), ends every worker at once and keeps the NCCL flight-recorder dumps
where they survive the run. Every round torchrun starts (``--max-restarts``) is watched
the same way; :meth:`HangWatch.last_word` gives the paragraph of the round that ended the
run. Files only, in a directory on this node: no home-made transport; on several nodes
each node's launcher names the ranks of its own node.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from torchgpu.launch.heartbeat import (
    FLIGHT_RECORDER_ENV,
    FLIGHT_RECORDER_FILE_ENV,
    FLIGHT_RECORDER_PREFIX,
    HEARTBEAT_ENV,
    PHASES,
    STALE_S,
    STARTUP_PHASES,
    STEP_PHASES,
    TICK_S,
    clip,
)

#: Where the dumps of a run without an output directory (``torchgpu launch``) are kept:
#: this name with the time appended, under the launcher's working directory.
DUMP_DIR_NAME = "torchgpu-flight-recorder"


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
    if phase == "stages":
        return f"in step {step + 1} (its stages' forward/backward, sends and receives)"
    if phase == "data":
        return f"loading the data of step {step + 1} (waiting for its next batch)"
    if phase in STARTUP_PHASES:
        return f"in {PHASES[phase]}"
    if phase == "done":
        return f"finished after step {step}"
    return f"in {PHASES.get(phase, phase)} after step {step}"


def _whereabouts(beat: dict[str, Any], now: float, done: int, by: str) -> str:
    """Where a rank that did not arrive was, from the freshest evidence: its heartbeat
    when its thread still wrote it; else (the whole process stopped running) what the
    waiting ranks prove -- they finished step ``done`` (``by`` names them), whose
    gradient all-reduce needs every rank -- with the stale heartbeat as its last known
    place."""
    step = int(beat.get("step", 0))
    age = now - float(beat.get("time", now))
    if age <= STALE_S:
        since = now - float(beat.get("progress_at", now))
        text = f"{_position(beat)}, " + (f"no step for {since:.1f} s" if step else
                                          f"no step done yet ({since:.1f} s since it started)")
        if beat.get("stack"):
            text += f", at {' <- '.join(beat['stack'])}"
        return text
    frozen = (f"its heartbeat stopped {age:.1f} s before this report: the whole process "
              "stopped running (stopped by SIGSTOP, a frozen node, swapping), since a hung "
              "call would still let its heartbeat thread write")
    last = _position(beat) + (f", at {' <- '.join(beat['stack'])}" if beat.get("stack") else "")
    if step < done:
        return (f"stopped after step {done} (rank(s) {by} finished it, which needs every "
                f"rank) and before the collective they waited in; {frozen}; its last "
                f"heartbeat, from before step {done}, said: {last}")
    return f"{frozen}; last known: {last}"


def diagnose(beats: dict[int, dict[str, Any]], dumps: list[Path] | None = None,
             aborted: frozenset[int] = frozenset(), now: float | None = None) -> str | None:
    """One paragraph naming the hang, or None when no rank recorded a timeout.

    Ranks that recorded a timeout waited in a collective; the ranks that recorded
    nothing did not arrive. ``aborted``: ranks NCCL's watchdog ended (SIGABRT) after a
    collective timeout, which records nothing from Python: they count as waiting where
    their heartbeat last was. A heartbeat older than :data:`STALE_S` at ``now`` is
    presented as such (its rank stopped running), with what the waiting ranks prove."""
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
    startup = phase in STARTUP_PHASES
    where = collective if startup else f"{collective} of step {step + 1}" \
        if phase in STEP_PHASES else f"{collective} after step {step}"
    world = int(first.get("world_size", len(beats)))
    missing = [r for r in range(world) if r not in waiting]
    timeout_s = failure.get("timeout_s")
    waited = f" for {float(timeout_s):g} s" if timeout_s else ""
    by = ", ".join(map(str, sorted(waiting)))
    absent = ", ".join(map(str, missing)) or "(none recorded)"
    if startup:  # a failure of the start-up, not a hang of the training
        head = (f"torchgpu: the start-up timed out: rank(s) {by} waited{waited} in {where}, "
                f"which rank(s) {absent} did not join")
    else:
        head = (f"torchgpu: the run hung: rank(s) {by} waited{waited} in {where}, which "
                f"rank(s) {absent} did not reach")
        loading = [str(r) for r in missing if (beats.get(r) or {}).get("phase") == "data"]
        if loading:
            head += (f": rank(s) {', '.join(loading)} hung in data loading (a slow or stuck "
                     "data loader)")
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
            text = f"rank {rank}: {_whereabouts(beat, now, step, by)}"
        line = clip(str(beat.get("line") or "").strip(), 160)
        places.append(text + (f"; last line: {line!r}" if line else "; printed nothing"))
    tail = ""
    if dumps:
        tail = (f" NCCL flight-recorder dumps: {', '.join(str(d) for d in dumps)} (read them "
                f"with: python -m torch.distributed.flight_recorder.fr_trace "
                f"{dumps[0].parent} --prefix {FLIGHT_RECORDER_PREFIX}).")
    advice = ("If building the model or loading the data legitimately takes that long, "
              "raise --startup-timeout." if startup else
              "Look at what the missing rank(s) do at that point (a stuck data loader, a "
              "rank-dependent branch that skips a collective, a deadlock); if a step "
              "legitimately takes longer, raise --collective-timeout.")
    return (f"{head}. Where each rank was: {'; '.join(places)}. Every worker was "
            f"stopped.{tail} {advice}")


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


class HangWatch:
    """A heartbeat directory for the workers, watched for hangs round after round.

    :meth:`installed` creates the directory, exports it (and, with ``flight_recorder``,
    NCCL's flight-recorder settings) to the workers through the environment and polls
    it. When a rank records a collective timeout it waits up to ``settle_s`` for the
    other ranks to record theirs (or exit), writes :attr:`report` (:func:`diagnose`),
    calls ``stop_workers`` (which must end every worker) and moves the flight-recorder
    dumps to ``dump_dir`` (default: ``./torchgpu-flight-recorder-<time>``, made only
    when there are dumps; later rounds get ``-round<N>`` appended). Then it keeps
    watching: the workers of a round torchrun restarts (``--max-restarts``) are told
    from the ended ones by their pids, and when they appear the previous round's
    paragraph is printed then, as history. The directory is removed on exit.
    """

    def __init__(self, stop_workers: Callable[[], None], dump_dir: Path | None = None,
                 flight_recorder: bool = False, settle_s: float = 1.5,
                 poll_s: float = TICK_S) -> None:
        self.stop_workers = stop_workers
        self.dump_dir = dump_dir
        self.flight_recorder = flight_recorder
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.report: str | None = None  # the latest round's paragraph, not yet superseded
        self.report_pids: frozenset[int] = frozenset()  # the workers it names
        self.rounds = 0  # hangs reported so far
        self.directory: Path | None = None
        self._ended: set[int] = set()  # pids of the workers of reported rounds
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._started = time.strftime("%Y%m%d-%H%M%S")

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

    def beats(self) -> dict[int, dict[str, Any]]:
        """The heartbeats of the current round (workers of reported rounds left out)."""
        assert self.directory is not None
        return {rank: beat for rank, beat in read_beats(self.directory).items()
                if beat.get("pid") not in self._ended}

    def _watch(self) -> None:
        while not self._done.wait(self.poll_s):
            beats = self.beats()
            if beats and self.report is not None:
                self._restarted()
            if not any((b.get("failure") or {}).get("kind") == "timeout" for b in beats.values()):
                continue
            deadline = time.monotonic() + self.settle_s
            while time.monotonic() < deadline and not self._done.is_set():
                beats = self.beats()
                if all(b.get("failure") or not _alive(b.get("pid")) for b in beats.values()):
                    break
                time.sleep(0.1)
            report = diagnose(beats, dumps=self.keep_dumps())
            self.stop_workers()
            with self._lock:
                self._ended.update(int(b["pid"]) for b in beats.values()
                                   if isinstance(b.get("pid"), int))
                self.report = report
                self.report_pids = frozenset(int(b["pid"]) for b in beats.values()
                                             if isinstance(b.get("pid"), int))
                self.rounds += 1

    def _restarted(self) -> None:
        """Workers of a new round appeared after a reported hang: torchrun restarted
        them, so that paragraph did not end the run; it is printed now."""
        with self._lock:
            report, self.report, self.report_pids = self.report, None, frozenset()
        if report is not None:
            print(f"{report} torchrun restarted the workers (--max-restarts).",
                  file=sys.stderr, flush=True)

    def last_word(self, failed: Collection[int] | None = None) -> str | None:
        """The paragraph that ends the run: the latest round's hang when the workers that
        failed (``failed``: their pids; None: unknown) are the ones it names; None when the
        run ended some other way (an earlier round's paragraph is then printed first, as
        history, so that no hang goes unreported)."""
        with self._lock:
            report, pids = self.report, self.report_pids
        if report is None:
            return None
        if failed is None or not pids or set(failed) & pids:
            return report
        self._restarted()
        return None

    def after_failure(self, aborted: frozenset[int]) -> str | None:
        """The hang paragraph after torchrun reported failed workers: for ranks NCCL's
        watchdog ended (``aborted``, SIGABRT), which the watcher could not see coming;
        None when the heartbeats show no hang."""
        if self.directory is None or not aborted:
            return None
        beats = self.beats()
        return diagnose(beats, dumps=self.keep_dumps(), aborted=aborted) if beats else None

    def keep_dumps(self) -> list[Path]:
        """The NCCL flight-recorder dumps, moved out of the heartbeat directory (which
        goes when the launcher exits) to :attr:`dump_dir` (see the class docstring)."""
        assert self.directory is not None
        found = sorted(self.directory.glob(f"{FLIGHT_RECORDER_PREFIX}*"))
        if not found:
            return []
        target = (self.dump_dir if self.dump_dir is not None
                  else Path(f"{DUMP_DIR_NAME}-{self._started}")).resolve()
        if self.rounds:
            target = target.with_name(f"{target.name}-round{self.rounds + 1}")
        kept: list[Path] = []
        for path in found:
            try:
                target.mkdir(parents=True, exist_ok=True)
                kept.append(Path(shutil.move(str(path), target / path.name)))
            except OSError as error:
                print(f"torchgpu: could not keep the flight-recorder dump {path} in "
                      f"{target} ({error}); it is removed with the heartbeat directory.",
                      file=sys.stderr)
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
