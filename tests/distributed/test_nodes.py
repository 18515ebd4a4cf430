"""Two "nodes" on one machine: two ``torchgpu launch --nnodes 2`` launchers meeting at a
c10d rendezvous on 127.0.0.1. Every fault of one node is named by the other within a
bound, and no process outlives a test (each launcher leads a process group of its own;
each worker records its pid, and the fixture kills whatever still runs)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import psutil
import pytest

from tests import procs
from tests.distributed.proctree import Session
from tests.procs import free_port

pytestmark = [pytest.mark.slow, procs.HEAVY]

#: A worker that all-reduces once every 0.2 s for STEPS steps, recording its pid (for the
#: fixture's clean-up) and its last step (for the test's timing) in files; rank CRASH (if
#: given) exits 3 after step 10.
WORKER = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torchgpu import init_distributed
out = Path(sys.argv[1])
crash = int(sys.argv[3]) if len(sys.argv) > 3 else -1
with init_distributed() as env:
    (out / f"pid{env.rank}").write_text(str(os.getpid()))
    for step in range(1, int(sys.argv[2]) + 1):
        t = torch.ones(1)
        dist.all_reduce(t)
        (out / f"step{env.rank}").write_text(str(step))
        time.sleep(0.2)
        if env.rank == crash and step == 10:
            os._exit(3)  # a crash: no teardown whose own failure could change the code
"""

#: Every test's bound on one launcher (a hang guard; what a test measures is far below).
BOUND_S = 120.0


class Nodes:
    """Launchers started by a test: ``start`` one, ``wait`` for it; all are killed (with
    their process groups and every worker pid recorded under ``out``) at the end."""

    def __init__(self, tmp_path: Path) -> None:
        self.out = tmp_path
        self.script = tmp_path / "worker.py"
        self.script.write_text(WORKER)
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *flags: str, nnodes: str = "2", steps: int = 100000,
              endpoint: str | None = None, crash: int = -1) -> subprocess.Popen[str]:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "torchgpu", "launch", "--nnodes", nnodes,
             "--rdzv-endpoint", endpoint or self.endpoint, "--nproc", "1", *flags,
             str(self.script), str(self.out), str(steps), str(crash)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=procs.test_env(), start_new_session=True,
        )
        self.started.append(launcher)
        return launcher

    def wait_step(self, step: int, timeout: float = procs.START_S) -> None:
        """Until both ranks have done ``step`` steps (both launchers still running)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [self._read(f"step{rank}") for rank in (0, 1)]
            if all(d is not None and d >= step for d in done):
                return
            for launcher in self.started:
                assert launcher.poll() is None, launcher.communicate()
            time.sleep(0.1)
        raise AssertionError(f"the workers did not reach step {step} in {timeout:g} s")

    def _read(self, name: str) -> int | None:
        try:
            return int((self.out / name).read_text())
        except (OSError, ValueError):
            return None

    def worker_pids(self) -> list[int]:
        return [pid for rank in (0, 1) if (pid := self._read(f"pid{rank}")) is not None]

    def close(self) -> list[int]:
        """Kill everything; the pids that were still running."""
        alive = []
        for launcher in self.started:
            if launcher.poll() is None:
                alive.append(launcher.pid)
                with suppress(ProcessLookupError):
                    os.killpg(launcher.pid, signal.SIGKILL)
            launcher.communicate(timeout=30)
        for pid in self.worker_pids():
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
                with suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        return alive


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[Nodes]:
    started = Nodes(tmp_path)
    try:
        yield started
    finally:
        left = started.close()
    assert not left, f"processes left running: {left}"


def _finish(launcher: subprocess.Popen[str], timeout: float = BOUND_S) -> tuple[int, str, float]:
    """(exit code, stderr, seconds it took) of a launcher, bounded by ``timeout``."""
    begun = time.monotonic()
    _, err = launcher.communicate(timeout=timeout)
    return launcher.returncode, err, time.monotonic() - begun


@pytest.mark.timeout(400)
@pytest.mark.parametrize("host", [False, True], ids=["peer", "store-host"])
def test_a_killed_launcher_is_named_by_the_other_node_within_seconds(
        nodes: Nodes, host: bool) -> None:
    """SIGKILL one launcher mid-run (one that joined the store; the one hosting it): its
    workers die with it, and the other launcher names the lost node and exits 1 within
    seconds -- it used to keep running (the killed launcher's workers ran on unsupervised)."""
    launchers = [nodes.start(), nodes.start()]
    nodes.wait_step(5)
    victim = next(launcher for launcher in launchers
                  if _listens(launcher.pid, nodes.endpoint) == host)
    survivor = launchers[1 - launchers.index(victim)]
    os.killpg(victim.pid, signal.SIGKILL)
    code, err, took = _finish(survivor, timeout=60)
    print(f"the survivor exited {took:.1f} s after the kill")  # shown with -s
    assert code == 1, err[-3000:]
    lost = ("the node hosting the rendezvous (one of 2) was lost" if host else
            f"(127.0.0.1, launcher pid {victim.pid}) of 2 was lost")
    assert lost in err, err[-3000:]
    # the survivor's worker may print its own failed collective ("[rank1]: ..."); the
    # launcher prints no traceback
    assert "Traceback" not in _launcher_lines(err), err[-3000:]
    assert took < 30, f"{took:.1f} s: {err[-3000:]}"
    deadline = time.monotonic() + 10  # the killed launcher's worker went with it
    while nodes.worker_pids() and any(_running(pid) for pid in nodes.worker_pids()):
        assert time.monotonic() < deadline, f"workers left running: {nodes.worker_pids()}"
        time.sleep(0.1)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_worker_that_fails_on_one_node_is_no_lost_node(nodes: Nodes, rank: int) -> None:
    """One node's worker exits 3 (a bug in the script): that node reports it, and the
    other node, whose worker then fails in its all-reduce, reports its own failure --
    neither names a lost node, whichever of them hosts the store (its launcher waits
    for the other's word before its exit takes the store away)."""
    launchers = [nodes.start(crash=rank), nodes.start(crash=rank)]
    results = [_finish(launcher) for launcher in launchers]
    codes = sorted(code for code, _, _ in results)
    assert codes == [1, 3], [err[-2000:] for _, err, _ in results]
    for _, err, _ in results:
        assert "was lost" not in err and "failed (exit code" in err, err[-3000:]


def _launcher_lines(err: str) -> str:
    return "\n".join(line for line in err.splitlines() if not line.startswith("[rank"))


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(200)
def test_a_node_that_never_arrives_is_named_after_rdzv_timeout(nodes: Nodes) -> None:
    launcher = nodes.start("--rdzv-timeout", "8")
    code, err, took = _finish(launcher)
    assert code == 1, err[-3000:]
    assert "only 1 of 2 nodes arrived" in err and nodes.endpoint in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert took < 60, f"{took:.1f} s"


@pytest.mark.timeout(200)
def test_mismatched_nnodes_is_an_error_on_both_nodes(nodes: Nodes) -> None:
    launchers = [nodes.start("--rdzv-timeout", "90"),
                 nodes.start("--rdzv-timeout", "90", nnodes="3")]
    for launcher in launchers:
        code, err, _ = _finish(launcher)
        assert code == 2, err[-3000:]
        assert "--nnodes disagrees" in err and "--nnodes 2" in err and "--nnodes 3" in err, err
        assert "Traceback" not in err, err[-3000:]


@pytest.mark.timeout(200)
def test_an_endpoint_that_is_no_store_is_one_paragraph(nodes: Nodes) -> None:
    """A port where another program listens (accepts, never answers as a store)."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)
        accepted: list[socket.socket] = []
        stop = threading.Event()

        def accept() -> None:
            squatter.settimeout(0.2)
            while not stop.is_set():
                try:
                    accepted.append(squatter.accept()[0])
                except OSError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        endpoint = f"127.0.0.1:{squatter.getsockname()[1]}"
        try:  # 4 s: the launcher sees the port listen on its first probe, 0.2 s in
            code, err, took = _finish(nodes.start("--rdzv-timeout", "4", endpoint=endpoint))
        finally:
            stop.set()
            thread.join(5)
            for conn in accepted:
                conn.close()
    assert code == 2, err[-3000:]
    assert endpoint in err and "does not answer as a torch store" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert took < 60, f"{took:.1f} s"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_at_the_rendezvous_ends_the_launcher_at_once(
        nodes: Nodes, sig: signal.Signals) -> None:
    """The launcher waits for a node that is not coming; a stop signal ends it within a
    few seconds (it used to be passed on to workers that did not exist, and waited)."""
    launcher = nodes.start()
    deadline = time.monotonic() + procs.START_S
    while not _listens(launcher.pid, nodes.endpoint):  # its store is up: it waits for the node
        assert time.monotonic() < deadline and launcher.poll() is None
        time.sleep(0.2)
    os.kill(launcher.pid, sig)
    code, err, took = _finish(launcher)
    print(f"{sig.name}: the launcher exited {took:.1f} s after it")  # shown with -s
    assert code == 128 + int(sig), err[-3000:]
    assert f"stopped by {sig.name} at the rendezvous" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert took < 10, f"{took:.1f} s"


def _listens(pid: int, endpoint: str) -> bool:
    """Whether the launcher ``pid`` listens at ``endpoint`` (it hosts the store)."""
    port = int(endpoint.rsplit(":", 1)[1])
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    except psutil.Error:
        return False


@pytest.mark.timeout(500)
def test_a_killed_train_launcher_is_named_with_the_step(tmp_path: Path) -> None:
    """``torchgpu train`` on two nodes, one launcher SIGKILLed mid-run: its workers stop
    with a checkpoint (they watch their launcher), the other node's stop with them, and
    that node's launcher names the lost node and the step and exits 1 within seconds --
    it used to exit 0 after torchrun's exit barrier waited 300 s for the dead launcher."""
    out = tmp_path / "run"
    args = ["train", "--example", "housing", "--data-size", "200", "--batch-size", "8",
            "--epochs", "100000", "--progress", "plain", "--device", "cpu", "--nproc", "1",
            "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
            "--save-every", "50", "--keep-last", "2", "--out", str(out)]
    dirs = [tmp_path / "a", tmp_path / "b"]
    for folder in dirs:
        folder.mkdir()
    with Session(args, dirs[0]) as first, Session(args, dirs[1]) as second:
        first.wait_for(out / "checkpoints" / "latest")
        second.look()
        endpoint = args[args.index("--rdzv-endpoint") + 1]
        victim, survivor = ((second, first) if _listens(first.pid, endpoint)
                            else (first, second))
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        code = survivor.wait(90)
        took = time.monotonic() - killed
        print(f"the survivor exited {took:.1f} s after the kill")  # shown with -s
        victim.wait(30)
    assert not first.leftovers and not second.leftovers, (first.leftovers, second.leftovers)
    err = survivor.stderr()
    assert code == 1, err[-3000:]
    assert f"(127.0.0.1, launcher pid {victim.pid}) of 2 was lost after step " in err, \
        err[-3000:]
    assert "Traceback" not in _launcher_lines(err), err[-3000:]
    assert took < 30, f"{took:.1f} s: {err[-3000:]}"
