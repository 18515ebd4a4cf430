"""SIGTERM and SIGINT from the entry point's first line to the process's exit.

Python's defaults are a traceback (SIGINT raises KeyboardInterrupt wherever the
interpreter is, an ``import torch`` included) or a silent death (SIGTERM skips every
``finally``, so temporary files stay). :func:`install` replaces both before anything is
imported, and the handler's answer depends on where the command is:

- **Starting** (the verb's module is being imported): nothing has been done yet, so the
  command ends at once with one line and 128 + the signal's number. An exception
  raised inside an import could be caught by the library being imported and leave it
  half-initialised; exiting cannot.
- **Running** (:func:`started`): the first signal raises :class:`Stopped` (a
  KeyboardInterrupt, so every ``with`` and ``finally`` on the way out runs and
  :func:`torchgpu.cli.common.run_guarded` prints one line); later ones are recorded
  only, so that cleanup is not cut short. Python runs a handler wherever the main
  thread is, a ``__del__`` or a weakref callback included, where an exception is only
  printed ("Exception ignored in ...") and lost: such a :class:`Stopped` is caught by
  this module's ``sys.unraisablehook`` and the signal is raised again, to land in the
  code that runs next. A verb that stops gracefully (``train``'s
  :class:`~torchgpu.launch.stop_record.StopFlag`, ``launch``'s forwarder) installs its own
  handlers over these while it runs.
- **A worker** of a torchgpu launcher (``torchgpu train`` under torchrun): signals are
  only recorded, from the first line on, in this process and in the run's stop record
  (:func:`torchgpu.launch.stop_record.record_stop`); the worker's stop flag takes them up and
  it stops cleanly, also before its process group exists. Its launcher starts it with
  both signals blocked, so one sent before :func:`install` runs waits for the handler
  instead of killing the process (:func:`install` unblocks them).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from torchgpu.stop_signals import STOP_SIGNALS

_REDELIVER_S = 0.01  # a Stopped lost in a finalizer is raised again this much later


class Stopped(KeyboardInterrupt):
    """A stop signal turned into an exception while a command runs; ``signum`` is the
    signal, and the command's exit code is 128 + ``signum``."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _State:
    mode = "off"  # off | starting | running | recording | done
    worker = False
    received: signal.Signals | None = None
    raised = False  # a Stopped is on its way out (not lost in a finalizer)
    record: Callable[[str, int | None], None] | None = None  # a worker's record_stop
    hook: Callable[[Any], object] | None = None  # the unraisablehook before ours


_state = _State()


def is_worker(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> bool:
    """Whether this process is a ``torchgpu train`` worker started by torchrun."""
    argv = sys.argv if argv is None else argv
    env = os.environ if environ is None else environ
    under_torchrun = "TORCHELASTIC_RUN_ID" in env or "LOCAL_RANK" in env
    return under_torchrun and argv[1:2] == ["train"]


def install() -> None:
    """Take over SIGTERM and SIGINT (main thread; the entry point's first statement),
    then unblock them (a torchgpu launcher starts its workers with both blocked)."""
    _state.worker = is_worker()
    _state.mode = "recording" if _state.worker else "starting"
    if _state.worker:  # imported now: not from a handler that may interrupt an import
        from torchgpu.launch.stop_record import record_stop

        _state.record = record_stop
    for sig in STOP_SIGNALS:
        signal.signal(sig, _handle)
    if _state.hook is None:
        _state.hook = sys.unraisablehook
        sys.unraisablehook = _unraisable
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, set(STOP_SIGNALS))


def started() -> None:
    """The verb's module is imported: from now on the first signal raises
    :class:`Stopped` (a worker keeps recording)."""
    if _state.mode == "starting":
        _state.mode = "running"


def settle() -> None:
    """The command's work is done and only its exit remains: both signals are ignored
    from now on (a signal now must not turn a finished command into a failed one, and
    the interpreter puts the default action back for Python handlers while it exits,
    which would kill the process with no word)."""
    if _state.mode != "off" and threading.current_thread() is threading.main_thread():
        _state.mode = "done"
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def received() -> signal.Signals | None:
    """The first stop signal this process received since :func:`install` (None: none)."""
    return _state.received


def _handle(signum: int, frame: FrameType | None) -> None:
    sig = signal.Signals(signum)
    first = _state.received is None
    if first:
        _state.received = sig
    if _state.worker:
        rank = os.environ.get("RANK", "")
        if _state.record is not None:
            _state.record(sig.name, int(rank) if rank.isdigit() else None)
        return
    if _state.mode == "starting":
        os.write(2, f"torchgpu: stopped by {sig.name} while starting; nothing was done.\n"
                 .encode())
        os._exit(128 + signum)
    if _state.mode == "running" and (first or sig == _state.received) and not _state.raised:
        _state.raised = True
        raise Stopped(signum)


def _unraisable(unraisable: Any) -> None:
    """A :class:`Stopped` raised inside a finalizer is lost there: raise the signal again
    (its handler then runs in the code that comes next). Anything else goes to the
    hook that was in place."""
    if isinstance(unraisable.exc_value, Stopped):
        if _state.mode == "running":
            _state.raised = False
            # Not raised again from here: its handler would run inside this hook.
            again = threading.Timer(_REDELIVER_S, os.kill,
                                    (os.getpid(), unraisable.exc_value.signum))
            again.daemon = True
            again.start()
        return
    previous = _state.hook or sys.__unraisablehook__
    previous(unraisable)
