"""Real signals to `torchgpu launch`: SIGTERM/SIGINT reach every worker (torchrun starts
them in sessions of their own, so a signal to the launcher's group would not), the
launcher exits with their status, workers that ignore the signal are killed after
--stop-timeout, and no process is left either way."""

from __future__ import annotations

import os
import signal
import textwrap
import time
from pathlib import Path

import pytest

from tests.distributed.proctree import Session
from tests.procs import START_S

pytestmark = pytest.mark.slow

# A worker that says when it is ready, then sleeps; on SIGTERM/SIGINT it writes which
# signal it got and exits 0, or (IGNORE set) carries on sleeping.
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path

    where = Path(sys.argv[1])
    rank = os.environ["RANK"]

    def stop(signum, frame):
        (where / f"got-{rank}").write_text(signal.Signals(signum).name)
        sys.exit(0)

    handler = signal.SIG_IGN if os.environ.get("IGNORE") else stop
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    (where / f"ready-{rank}").write_text("")
    time.sleep(120)
""")


def _start(tmp_path: Path, *flags: str, **env: str) -> Session:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    return Session(["launch", "--nproc", "2", *flags, str(script), str(tmp_path)], tmp_path,
                   **env)


def _ready(run: Session, tmp_path: Path) -> None:
    for rank in (0, 1):
        run.wait_for(tmp_path / f"ready-{rank}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_group_reaches_every_worker_and_exits_0(
    tmp_path: Path, sig: signal.Signals
) -> None:
    with _start(tmp_path) as run:
        _ready(run, tmp_path)
        os.killpg(run.pid, sig)
        code = run.wait(60)
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 0, run.stderr()[-3000:]
    assert "Traceback" not in run.stderr()
    for rank in (0, 1):
        assert (tmp_path / f"got-{rank}").read_text() == sig.name


def test_workers_ignoring_sigterm_are_killed_after_the_stop_timeout(tmp_path: Path) -> None:
    with _start(tmp_path, "--stop-timeout", "2", IGNORE="1") as run:
        _ready(run, tmp_path)
        sent = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        # ~3 s on a quiet machine; the default --stop-timeout (60 s) would outlast the wait
        code = run.wait(50)
        took_s = time.monotonic() - sent
    err = run.stderr()
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert took_s >= 2
    # the kill came from the 2 s timer (the launcher's own words), not from elsewhere
    assert "still running 2 s after SIGTERM were killed" in err
    assert "worker rank 0 of" in err and "(signal 9)" in err
    assert "Traceback" not in err


def test_stop_timeout_must_be_positive(tmp_path: Path) -> None:
    with _start(tmp_path, "--stop-timeout", "0") as run:
        code = run.wait(START_S)
    assert code == 2
    assert "--stop-timeout 0.0 is out of range" in run.stderr()


def test_torchrun_leaves_sigterm_and_sigint_to_the_launcher() -> None:
    """The forwarding needs torchrun's --signals-to-handle (without it, torchrun's agent
    tears the workers down on SIGTERM); the agent keeps the other signals."""
    from torch.distributed.run import get_args_parser

    from torchgpu.launch.run import LaunchSpec, torchrun_args
    from torchgpu.launch.stop import agent_signals

    args = get_args_parser().parse_args(torchrun_args(LaunchSpec(nproc=2), "x.py", []))
    assert hasattr(args, "signals_to_handle")
    assert agent_signals(args.signals_to_handle) == "SIGHUP,SIGQUIT"
    assert agent_signals("SIGTERM, SIGINT") == "SIGHUP"
    assert agent_signals("SIGUSR1,SIGTERM") == "SIGUSR1"


# A script that does not handle the signals: SIGTERM ends it. Each start is recorded.
PLAIN = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    Path(sys.argv[1], f"ready-{os.environ['RANK']}-{restart}").write_text("")
    time.sleep(120)
""")


def test_a_worker_ended_by_sigterm_is_a_stop_not_restarted(tmp_path: Path) -> None:
    """SIGTERM to one worker of `launch --max-restarts 1`: torchrun counted its death a
    failure and restarted the group (the script ran again); a stop is never restarted,
    and it is reported as a stop with 128 + 15."""
    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    with Session(["launch", "--nproc", "2", "--max-restarts", "1", str(script),
                  str(tmp_path)], tmp_path) as run:
        for rank in (0, 1):
            run.wait_for(tmp_path / f"ready-{rank}-0")
        os.kill(run.worker(1), signal.SIGTERM)
        code = run.wait(60)
    err = run.stderr()
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 128 + signal.SIGTERM, err[-3000:]
    assert "torchgpu: stopped by SIGTERM" in err and "failed" not in err.split("torchgpu:")[-1]
    assert sorted(p.name for p in tmp_path.glob("ready-*")) == ["ready-0-0", "ready-1-0"]
    assert "Traceback" not in err
