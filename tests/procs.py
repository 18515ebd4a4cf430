"""Bounded subprocess helpers for tests: every spawned process ends within a timeout,
and all traffic stays on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"

#: A bound on waiting for a ``torchgpu`` run (or a torchrun group) to get going or to
#: end -- a hang guard, not a claim about speed: starting the launcher and each worker
#: (Python, torch, the run's assembly) takes ~10 s on a quiet machine and was seen at
#: 86 s on a loaded 2-core one running the suite with ``-n 2``. Tests that bound how
#: fast something happens measure an interval inside the run instead (from a file's
#: time or a line the run prints), with a bound far from what they guard against.
START_S = 240.0

#: The heaviest multi-process tests (several runs in a row, restarts): ``make test``
#: (``-n 2 --dist loadgroup``) gives them all to one xdist worker, one after another, so
#: that two of them never share the 2-core machine at once. Each also carries a
#: ``pytest.mark.timeout`` sized for its runs on a loaded machine.
HEAVY = pytest.mark.xdist_group("heavy-multiprocess")


def test_env(**extra: str) -> dict[str, str]:
    """The environment for a child process: src on the path, one thread, loopback only."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MASTER_ADDR"] = "127.0.0.1"
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["MPLBACKEND"] = "Agg"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


test_env.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test, when imported


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cli(
    args: Sequence[str], timeout: float = START_S, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m torchgpu ARGS`` in a child process, bounded by ``timeout`` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "torchgpu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=test_env(**env),
        check=False,
    )


def run_main(argv: Sequence[str], capsys: Any) -> tuple[int, str]:
    """``torchgpu ARGV`` in this process: (exit code, stderr), argparse's exits counted;
    fails the test on a traceback (``capsys``: pytest's fixture)."""
    from torchgpu.cli.main import main

    try:
        code = main(list(argv))
    except SystemExit as exited:
        code = int(exited.code or 0)
    err: str = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err


def run_script_here(script: Path | str, args: Sequence[str]) -> str:
    """``python SCRIPT ARGS`` run in this interpreter (``runpy``, as ``__main__``): a
    one-process reference run without a process's start-up (Python, torch and torchgpu
    imports, ~3 CPU-seconds) to pay again. Returns what it printed to stdout;
    ``sys.argv`` and ``sys.path`` are put back after. Not for a run that forks (DataLoader
    workers): a fork of a shared xdist worker copies the locks other tests' threads hold."""
    import contextlib
    import io
    import runpy

    out = io.StringIO()
    argv, path = sys.argv[:], sys.path[:]
    sys.argv = [str(script), *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv, sys.path[:] = argv, path
    return out.getvalue()


def run_torchrun(
    script: Path | str,
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = START_S,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under torchrun (``torch.distributed.run``) with ``nproc`` gloo
    processes on 127.0.0.1, bounded by ``timeout`` seconds."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--nnodes=1",
        # port 0: the agent binds a free port itself (a port picked here first could be taken
        # by another test before torchrun binds it: its store then never answers)
        "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0",
        "--max-restarts=0", str(script), *args,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=test_env(**env), check=False
    )
