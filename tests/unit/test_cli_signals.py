"""torchgpu.cli.signals in a process of its own: a stop signal raised while a finalizer
runs (Python prints "Exception ignored in ..." and drops such an exception) still stops
the command, with one line and 128 + the signal's number; a signal once the work is done
changes nothing."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.procs import test_env

IN_A_FINALIZER = textwrap.dedent("""
    import gc, os, signal, sys, time
    from torchgpu.cli import signals
    from torchgpu.cli.common import run_guarded

    class Dropped:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:  # the handler runs here, in __del__
                pass

    def verb(argv):
        item = Dropped()
        del item
        time.sleep(5)  # the signal, raised again, lands here
        return 0

    signals.install()
    signals.started()
    sys.exit(run_guarded(verb, []))
""")

AFTER_THE_WORK = textwrap.dedent("""
    import os, signal, sys, time
    from torchgpu.cli import signals

    signals.install()
    signals.started()
    print("done", flush=True)
    signals.settle()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.2)
    sys.exit(0)
""")


def _run(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, env=test_env(), check=False)


def test_a_stop_raised_inside_a_finalizer_is_not_lost() -> None:
    done = _run(IN_A_FINALIZER)
    assert done.returncode == 143, done.stderr
    assert done.stderr.strip() == "torchgpu: stopped by SIGTERM", done.stderr


def test_a_signal_after_the_work_is_done_changes_nothing() -> None:
    done = _run(AFTER_THE_WORK)
    assert done.returncode == 0 and done.stdout == "done\n" and done.stderr == "", done.stderr


def test_a_reader_that_leaves_is_not_an_error() -> None:
    """``torchgpu devices --json | head``: a BrokenPipeError is exit 0 with no traceback
    (the guard's catch-all for stop signals must not swallow it first)."""
    code = ("import sys\n"
            "from torchgpu.cli.common import run_guarded\n"
            "def verb(argv):\n"
            "    raise BrokenPipeError(32, 'Broken pipe')\n"
            "sys.exit(run_guarded(verb, []))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=test_env())
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
