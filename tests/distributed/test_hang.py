"""A rank that never reaches a collective is named, within the collective timeout.

Two gloo processes on 127.0.0.1 (`torchgpu train --nproc 2`), one of them blocked for
good before a step's gradient all-reduce by the test-only fault hook
(TORCHGPU_FAULT_HANG_AT_STEP / TORCHGPU_FAULT_RANK): the run must end within the
`--collective-timeout` plus a small margin after the hang, exit 1, print one paragraph
naming the rank that did not arrive, the step and the collective, where each rank was
and its last line, and leave no process behind. And a launcher killed with SIGKILL (no
handler runs) does not leave its workers training unseen: they stop, saved.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.distributed.proctree import Session, running
from tests.procs import HEAVY, SRC, START_S
from torchgpu.checkpoint import verify_checkpoint
from torchgpu.launch.heartbeat import FLIGHT_RECORDER_PREFIX

# a start (START_S at most) and a bounded end
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TIMEOUT_S = 3
# After the hang: the timeout, the watcher's poll and settle (< 2 s), torchrun noticing
# and tearing down: ~5 s on a quiet machine. Without the watcher a hang costs the
# timeout, the timed-out rank's wait for it (heartbeat.AWAIT_KILL_S, 10 s), then
# torchrun's 30 s grace before its SIGKILL: the bound stays well under that, with room
# for a loaded machine. That the watcher ended the timed-out rank within AWAIT_KILL_S
# (timed by that rank itself) is asserted by the absence of its own error (_last_word).
MARGIN_S = 25.0
COMMON = ["train", "--example", "housing", "--data-size", "200", "--batch-size", "8",
          "--epochs", "50", "--progress", "plain", "--device", "cpu", "--nproc", "2",
          "--strategy", "ddp", "--collective-timeout", str(TIMEOUT_S)]


def _hang(tmp_path: Path, rank: int, step: int, *extra: str) -> tuple[int, str, float]:
    """Run with ``rank`` hanging before step ``step``; (exit code, stderr, seconds from the
    hang to the launcher's exit)."""
    return _until_exit(Session([*COMMON, *extra, "--out", str(tmp_path / "run")], tmp_path,
                               TORCHGPU_FAULT_HANG_AT_STEP=str(step),
                               TORCHGPU_FAULT_RANK=str(rank)))


def _until_exit(session: Session) -> tuple[int, str, float]:
    """Wait for ``session``'s planted hang, then for its exit; (exit code, stderr, seconds
    from the hang to the exit). No process may be left."""
    with session as run:
        deadline = time.monotonic() + START_S
        while "fault injection: hanging" not in run.stdout():
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr()[-3000:]
            run.look()
            time.sleep(0.05)
        hung = time.monotonic()
        run.look()
        code = run.wait(TIMEOUT_S + MARGIN_S + 30)
        took = time.monotonic() - hung
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    return code, run.stderr(), took


def test_a_rank_that_never_reaches_the_gradient_all_reduce_is_named(tmp_path: Path) -> None:
    code, err, took = _hang(tmp_path, rank=1, step=3)
    assert code == 1, err[-3000:]
    assert took < TIMEOUT_S + MARGIN_S, f"the run ended {took:.1f} s after the hang"
    paragraph = next(line for line in err.splitlines() if "the run hung" in line)
    assert (f"rank(s) 0 waited for {TIMEOUT_S} s in the gradient all-reduce of step 3, "
            "which rank(s) 1 did not reach") in paragraph
    # where each rank was: rank 0 waiting (gloo's own words), rank 1 in step 3 with its
    # stack and its last printed line
    assert "rank 0: waiting in the gradient all-reduce of step 3 (timed out: Timed out" \
        in paragraph
    assert "rank 1: in step 3" in paragraph and "faults.py" in paragraph
    assert "last line: \"fault injection: hanging before step 3" in paragraph
    assert "--collective-timeout" in paragraph
    _last_word(err, paragraph)


def _last_word(err: str, paragraph: str) -> None:
    """The launcher's paragraph ends the output, with no noise before it: no rank's own
    error (the timed-out rank waits to be ended), no torchrun line for the workers the
    watch killed, no traceback."""
    assert err.strip().splitlines()[-1] == paragraph, err[-3000:]
    assert "another rank never joined it" not in err, err[-3000:]
    assert "failed (exitcode" not in err and "Traceback" not in err, err[-3000:]


def test_rank_0_hanging_under_accumulation_is_named_too(tmp_path: Path) -> None:
    code, err, took = _hang(tmp_path, 0, 2, "--accumulate", "2", "--save-every", "1")
    assert code == 1, err[-3000:]
    assert took < TIMEOUT_S + MARGIN_S, f"the run ended {took:.1f} s after the hang"
    paragraph = next(line for line in err.splitlines() if "the run hung" in line)
    assert ("rank(s) 1 waited for 3 s in the gradient all-reduce of step 2, which "
            "rank(s) 0 did not reach") in paragraph, paragraph
    assert "rank 0: in step 2" in paragraph and "no step for" in paragraph
    _last_word(err, paragraph)
    # step 1's checkpoint is there to resume from
    assert (tmp_path / "run" / "checkpoints" / "step-00000001").is_dir()


@HEAVY
def test_every_round_of_max_restarts_is_watched(tmp_path: Path) -> None:
    """--max-restarts 1 and a rank that hangs in both rounds: each round is ended within
    the timeout, the first round's paragraph is printed when torchrun restarts, and the
    last word is the second round's (its hung worker's pid), well before torchrun's own
    30 s grace period would end it. DataLoader workers (--num-workers 2) add no traceback."""
    args = [*COMMON, "--max-restarts", "1", "--num-workers", "2", "--out",
            str(tmp_path / "run")]
    env = {"TORCHGPU_FAULT_HANG_AT_STEP": "3", "TORCHGPU_FAULT_RANK": "1"}
    with Session(args, tmp_path, **env) as run:
        hangs: list[float] = []
        deadline = time.monotonic() + 2 * START_S
        while len(hangs) < 2:
            seen = run.stdout().count("fault injection: hanging")
            if seen > len(hangs):
                hangs.append(time.monotonic())
                continue
            assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr()[-3000:]
            run.look()
            time.sleep(0.05)
        code = run.wait(TIMEOUT_S + MARGIN_S + 30)
        took = time.monotonic() - hangs[1]
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    err, out = run.stderr(), run.stdout()
    assert code == 1, err[-3000:]
    assert took < TIMEOUT_S + MARGIN_S, f"the run ended {took:.1f} s after the second hang"
    pids = re.findall(r"fault injection: hanging before step 3's gradient all-reduce "
                      r"\(pid (\d+)\)", out)
    assert len(pids) == 2 and pids[0] != pids[1], out
    paragraphs = [line for line in err.splitlines() if "the run hung" in line]
    assert len(paragraphs) == 2, err[-5000:]
    assert f"(pid {pids[0]})" in paragraphs[0] and "torchrun restarted the workers" in \
        paragraphs[0]
    assert f"(pid {pids[1]})" in paragraphs[1] and "restarted" not in paragraphs[1]
    _last_word(err, paragraphs[1])


def test_a_hang_in_a_users_fit_script_under_launch_is_named(tmp_path: Path) -> None:
    """The same for the user's own model: torchgpu.fit on a causal LM (dict batches) in a
    script started by `torchgpu launch --nproc 2`. NCCL's flight-recorder dumps,
    simulated (each worker writes one where TORCH_FR_DUMP_TEMP_FILE points on NCCL), are
    kept in --flight-recorder-dir, not removed with the heartbeat directory."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(
        "import os\n"
        "d, r = os.environ.get('TORCHGPU_HEARTBEAT_DIR'), os.environ.get('RANK')\n"
        "if d and r is not None and os.path.isdir(d):\n"
        f"    with open(os.path.join(d, '{FLIGHT_RECORDER_PREFIX}' + r), 'w') as f:\n"
        "        f.write('dump of rank ' + r)\n")
    script = Path(__file__).with_name("fit_lm_script.py")
    dumps = tmp_path / "fr"
    args = ["launch", "--nproc", "2", "--flight-recorder-dir", str(dumps), str(script),
            str(tmp_path / "run"), "4", "samples=400", f"collective_timeout={TIMEOUT_S}"]
    code, err, took = _until_exit(Session(
        args, tmp_path, TORCHGPU_FAULT_HANG_AT_STEP="4", TORCHGPU_FAULT_RANK="1",
        PYTHONPATH=os.pathsep.join([str(SRC), str(inject)])))
    assert code == 1, err[-3000:]
    assert took < TIMEOUT_S + MARGIN_S, f"the run ended {took:.1f} s after the hang"
    paragraph = next(line for line in err.splitlines() if "the run hung" in line)
    assert ("rank(s) 0 waited for 3 s in the gradient all-reduce of step 4, which rank(s) 1 "
            "did not reach") in paragraph, err[-3000:]
    assert sorted(p.read_text() for p in dumps.iterdir()) == ["dump of rank 0",
                                                              "dump of rank 1"]
    assert f"NCCL flight-recorder dumps: {dumps / FLIGHT_RECORDER_PREFIX}0" in paragraph
    _last_word(err, paragraph)


def test_workers_of_a_killed_launcher_stop_saved_and_leave_nothing(tmp_path: Path) -> None:
    """SIGKILL to the launcher runs no handler: its workers see their parent change (the
    heartbeat thread), stop at one step boundary with a checkpoint, and exit."""
    out = tmp_path / "run"
    args = [*COMMON[:-2], "--epochs", "100000", "--save-every", "50", "--keep-last", "2",
            "--out", str(out)]
    with Session(args, tmp_path) as run:
        run.wait_for(out / "checkpoints" / "latest")
        workers = [run.worker(0), run.worker(1)]
        os.kill(run.pid, signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + 90
        while any(running(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - killed
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    # ~2 s on a quiet machine; unnoticed, the workers would train for hours
    assert took < 60, f"workers ran {took:.1f} s after the launcher was killed"
    assert "the launcher (pid" in run.stderr()
    latest = (out / "checkpoints" / "latest").read_text().strip()
    verify_checkpoint(out / "checkpoints" / latest)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and "SIGTERM" in summary["stop_reason"]
    assert summary["stop_steps_by_rank"][0] == summary["stop_steps_by_rank"][1]
    assert f"step-{summary['stopped_at_step']:08d}" == latest
