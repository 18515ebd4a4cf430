"""The ``torchgpu`` entry point ends a process that loaded torch without the interpreter's
teardown (about a second under load), after flushing stdout and running the atexit
handlers; a process with a non-daemon thread still running exits the normal way.

The child imports torch, keeps an object whose ``__del__`` writes a file when the
interpreter frees the module's globals (its teardown), registers an atexit handler that
writes another, then runs ``torchgpu env --json`` through the real entry point.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.procs import test_env

CHILD = """
import atexit, sys, threading, time
import torch

ran, torn, mode = sys.argv[1:]

class Marker:
    def __del__(self, write=open, path=torn):  # bound now: the teardown clears builtins
        with write(path, "w") as f:
            f.write("torn down")

def at_exit():
    with open(ran, "w") as f:
        f.write("atexit ran")

keep = Marker()
atexit.register(at_exit)
if mode == "thread":  # a non-daemon thread the normal exit waits for
    threading.Thread(target=time.sleep, args=(1.0,)).start()
sys.argv = ["torchgpu", "env", "--json"]
from torchgpu.cli.main import entry
entry()
"""


def _run(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess[str], Path, Path]:
    ran, torn = tmp_path / "atexit", tmp_path / "teardown"
    done = subprocess.run([sys.executable, "-c", CHILD, str(ran), str(torn), mode],
                          capture_output=True, text=True, timeout=120, env=test_env(),
                          cwd=tmp_path, check=False)
    return done, ran, torn


def test_exit_skips_the_teardown_after_flushing_and_atexit(tmp_path: Path) -> None:
    done, ran, torn = _run(tmp_path, "plain")
    assert done.returncode == 0, done.stderr
    assert "versions" in json.loads(done.stdout)  # stdout flushed, whole
    assert ran.read_text() == "atexit ran"
    assert not torn.exists()  # the interpreter did not free the modules


def test_a_running_thread_gets_the_normal_exit(tmp_path: Path) -> None:
    done, ran, torn = _run(tmp_path, "thread")
    assert done.returncode == 0, done.stderr
    assert ran.read_text() == "atexit ran"
    assert torn.read_text() == "torn down"
