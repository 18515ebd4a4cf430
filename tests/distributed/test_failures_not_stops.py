"""Failures are not stops: a worker that crashes, or a start-up or a step that times out,
fails the round (restarted with --max-restarts, exit non-zero otherwise), even when
torchrun's own teardown SIGTERM reached the other workers before they ended. Only a
signal from outside the launcher is a stop. Two gloo processes on 127.0.0.1, faults
planted by tests/distributed/faulty.py; no process is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.faulty import marks
from tests.distributed.proctree import Session
from tests.procs import REPO

pytestmark = pytest.mark.slow

SCRIPT = REPO / "tests" / "distributed" / "faulty_fit_script.py"
SPECS = ["--model", f"{REPO}/tests/distributed/faulty.py:model",
         "--data", f"{REPO}/tests/distributed/faulty.py:data", "--loss", "mse"]


def _launch(tmp_path: Path, args: list[str], bound_s: float, **env: str) -> tuple[int, str]:
    """Run ``torchgpu ARGS`` to its end within ``bound_s``; (exit code, stderr). No
    process may be left."""
    with Session(args, tmp_path, FAULTY_MARK=str(tmp_path / "marks"), **env) as run:
        code = run.wait(bound_s)
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    return code, run.stderr()


def test_a_crash_while_the_other_rank_is_busy_is_restarted_not_a_stop(tmp_path: Path) -> None:
    """Rank 0 is SIGKILLed while rank 1 is still loading its batch (not yet in the
    all-reduce that would fail on the lost peer): torchrun's teardown SIGTERM reaches
    rank 1 alive, which records it as any SIGTERM. That is the teardown, not a stop: the
    round is restarted (--max-restarts 1) and the run finishes, exit 0."""
    args = ["launch", "--nproc", "2", "--max-restarts", "1", str(SCRIPT), str(tmp_path / "run")]
    code, err = _launch(tmp_path, args, 150, FAULTY_ITEM="0:10:kill,1:10:sleep=4")
    assert code == 0, err[-3000:]
    assert "stopped by" not in err, err[-3000:]
    assert sorted(m.split(" pid")[0] for m in marks(tmp_path / "marks")) == \
        ["kill 0", "sleep 1"]  # the faults happened, in the first round only
    assert (tmp_path / "run" / "summary.json").exists()


def test_a_crash_is_restarted_every_time(tmp_path: Path) -> None:
    """`torchgpu train --max-restarts 1` with rank 0 SIGKILLed mid-run, a few times over:
    each run is restarted once and finishes (exit 0), never taken for a stop, however
    the teardown raced with rank 1's own end."""
    for attempt in range(3):
        where = tmp_path / f"try-{attempt}"
        where.mkdir()
        args = ["train", "--example", "housing", "--data-size", "100", "--batch-size", "8",
                "--epochs", "3", "--progress", "off", "--device", "cpu", "--nproc", "2",
                "--save-every", "4", "--max-restarts", "1", "--out", str(where / "run")]
        code, err = _launch(where, args, 120, TORCHGPU_FAULT_CRASH_AT_STEP="6",
                            TORCHGPU_FAULT_MARKER=str(where / "crashed"), TORCHGPU_FAULT_RANK="0")
        assert code == 0, f"attempt {attempt}: {err[-3000:]}"
        assert (where / "crashed").exists() and "torchrun restart 1: resuming from" in err
        assert "stopped by" not in err


def test_a_slow_start_up_is_a_named_failure_and_restarted(tmp_path: Path) -> None:
    """Rank 0 takes 15 s to build its model (first round only), rank 1 waits for it at most
    --startup-timeout 4 s (--collective-timeout 3 s is for the collectives after it): the
    start-up fails, named (which rank waited, in which phase, which rank did not join,
    the flag to raise), is no stop, and --max-restarts 1 restarts it; the run finishes."""
    args = ["train", *SPECS, "--epochs", "2", "--batch-size", "4", "--progress", "off",
            "--device", "cpu", "--nproc", "2", "--max-restarts", "1", "--startup-timeout",
            "4", "--collective-timeout", "3", "--out", str(tmp_path / "run")]
    code, err = _launch(tmp_path, args, 150, FAULTY_BUILD="0:15")
    assert code == 0, err[-3000:]
    assert "stopped by" not in err, err[-3000:]
    paragraph = next(line for line in err.splitlines() if "start-up timed out" in line)
    assert ("rank(s) 1 waited for 4 s in forming the process group (start-up), which "
            "rank(s) 0 did not join") in paragraph, paragraph
    assert "rank 0: in its start-up (building the model" in paragraph, paragraph
    assert "faulty.py" in paragraph  # where rank 0 was: in the model's factory
    assert "raise --startup-timeout" in paragraph and "torchrun restarted" in paragraph
    assert [m.split(" pid")[0] for m in marks(tmp_path / "marks")] == ["build 0"]
    assert (tmp_path / "run" / "summary.json").exists()


def test_a_rank_slow_in_data_loading_is_a_named_hang_not_a_stop(tmp_path: Path) -> None:
    """Rank 0's tenth item (its eighth in training, in step 2) takes 30 s to load, longer
    than --collective-timeout 3: rank 1 times out in the gradient all-reduce. The run
    fails (exit 1, not 143) with the hang's paragraph naming rank 0's data loading as
    where it was."""
    args = ["train", *SPECS, "--epochs", "20", "--batch-size", "4", "--progress", "off",
            "--device", "cpu", "--nproc", "2", "--strategy", "ddp", "--collective-timeout",
            "3", "--out", str(tmp_path / "run")]
    code, err = _launch(tmp_path, args, 120, FAULTY_ITEM="0:10:sleep=30")
    assert code == 1, err[-3000:]
    assert "stopped by" not in err, err[-3000:]
    paragraph = next(line for line in err.splitlines() if "the run hung" in line)
    assert ("rank(s) 1 waited for 3 s in the gradient all-reduce of step 2, which rank(s) 0 "
            "did not reach: rank(s) 0 hung in data loading") in paragraph, paragraph
    assert "rank 0: loading the data of step 2 (waiting for its next batch)" in paragraph
    assert "faulty.py" in paragraph and "in __getitem__" in paragraph, paragraph
    assert err.strip().splitlines()[-1] == paragraph  # the run's last word
