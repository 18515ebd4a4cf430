"""Resuming an fsdp run on another number of processes (gloo on CPU, 127.0.0.1): the
sharded checkpoint's model and Adam state are re-sharded by DCP, the position converts at
the sample level and the accumulation keeps the global batch, for 2 -> 1 (``--resume``
and a crashed job requeued with ``--autoresume``), 1 -> 2 and 4 -> 2 fsdp processes, and
fsdp's shards -> 2 ddp processes; each ends with the uninterrupted run's weights to float
tolerance. A one-file (ddp/single) checkpoint continued by more fsdp processes is refused
in one paragraph, exit 2, before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.distributed.test_world_change_gloo import COMMON, _same_weights
from tests.procs import HEAVY, run_cli, run_main

pytestmark = [pytest.mark.slow, HEAVY, pytest.mark.timeout(900)]

FSDP = ["--strategy", "fsdp"]


def _train_here(args: list[str]) -> Any:
    """One process, in this interpreter (the runner's result)."""
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.runner import train

    return train(config_from_argv([*COMMON, *args]))


def _cli(args: list[str], **env: str) -> str:
    done = run_cli(["train", *COMMON, *args], timeout=300, **env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _step(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step:08d}"


@pytest.fixture(scope="module")
def two_fsdp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-process fsdp run (2 x 8, global batch 16), saved every step."""
    out = tmp_path_factory.mktemp("fsdp-world") / "two"
    _cli([*FSDP, "--nproc", "2", "--batch-size", "8", "--save-every", "1", "--out", str(out)])
    assert (_step(out, 3) / "shards").is_dir()
    return out


def test_two_fsdp_processes_resume_on_one(two_fsdp: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "one"
    result = _train_here([*FSDP, "--batch-size", "8", "--resume", str(_step(two_fsdp, 3)),
                          "--out", str(out)])
    err = capsys.readouterr().err
    assert "2 x 8 x accumulate 1 then, 1 x 8 x accumulate 2 now" in err, err
    assert result.config.accumulate == 2 and result.summary["steps"] == 12
    with capsys.disabled():
        _same_weights(two_fsdp, out, "fsdp 2 -> 1 processes from step 3")


def test_a_crashed_two_process_job_autoresumes_on_one(
        two_fsdp: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job"
    job = [*FSDP, "--batch-size", "8", "--save-every", "2", "--out", str(out), "--autoresume"]
    crashed = run_cli(["train", *COMMON, *job, "--nproc", "2"], timeout=300,
                      TORCHGPU_FAULT_CRASH_AT_STEP="5",
                      TORCHGPU_FAULT_MARKER=str(tmp_path / "crashed"))
    assert crashed.returncode != 0, crashed.stderr[-3000:]
    assert _step(out, 4).is_dir() and not (out / "model.safetensors").exists()
    _train_here(job)  # requeued with one process
    err = capsys.readouterr().err
    assert "--autoresume: continuing the run" in err
    assert "2 x 8 x accumulate 1 then, 1 x 8 x accumulate 2 now" in err, err
    with capsys.disabled():
        _same_weights(two_fsdp, out, "fsdp 2 -> 1 processes, --autoresume from step 4")


def test_one_fsdp_process_resumes_on_two(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    _train_here([*FSDP, "--batch-size", "8", "--accumulate", "2", "--save-every", "1",
                 "--out", str(one)])
    capsys.readouterr()
    assert (_step(one, 4) / "shards").is_dir()  # one fsdp process writes shards too
    err = _cli([*FSDP, "--nproc", "2", "--batch-size", "8", "--accumulate", "2",
                "--resume", str(_step(one, 4)), "--out", str(two)])
    assert "1 x 8 x accumulate 2 then, 2 x 8 x accumulate 1 now" in err, err
    with capsys.disabled():
        _same_weights(one, two, "fsdp 1 -> 2 processes from step 4")


def test_four_fsdp_processes_resume_on_two_fsdp_or_ddp(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    four = tmp_path / "four"
    _cli([*FSDP, "--nproc", "4", "--batch-size", "4", "--save-every", "2", "--out", str(four)])
    for strategy in ("fsdp", "ddp"):
        two = tmp_path / f"two-{strategy}"
        err = _cli(["--strategy", strategy, "--nproc", "2", "--batch-size", "4", "--resume",
                    str(_step(four, 4)), "--out", str(two)])
        assert "4 x 4 x accumulate 1 then, 2 x 4 x accumulate 2 now" in err, err
        with capsys.disabled():
            _same_weights(four, two, f"fsdp 4 -> {strategy} 2 processes from step 4")


def test_a_one_file_checkpoint_on_more_fsdp_processes_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one, out = tmp_path / "one", tmp_path / "refused"
    _train_here(["--strategy", "single", "--batch-size", "8", "--accumulate", "2",
                 "--save-every", "2", "--epochs", "1", "--out", str(one)])
    capsys.readouterr()
    code, err = run_main(["train", *COMMON, *FSDP, "--nproc", "2", "--batch-size", "8",
                          "--resume", str(_step(one, 2)), "--out", str(out)], capsys)
    assert code == 2
    text = " ".join(err.split())
    assert "saved by 1 process(es) of --strategy single as one file" in text, text
    assert "Resume with --strategy ddp" in text and "torchgpu ckpt convert" in text
    assert len([x for x in err.strip().splitlines() if x.strip()]) == 1  # one paragraph
    assert not out.exists()  # nothing written
