"""Resuming a ddp/single run on another number of processes (gloo on CPU, 127.0.0.1):
2 -> 1, 1 -> 2 and 4 -> 2 processes continue a checkpoint saved mid-epoch (and at an
epoch's end) with the accumulation that keeps the effective batch, and end with the
uninterrupted run's weights to float tolerance; a world size that cannot keep it is
refused in one paragraph, exit 2, before anything is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import HEAVY, run_cli, run_main

pytestmark = [pytest.mark.slow, HEAVY, pytest.mark.timeout(900)]

# 106 rows -> 85 training rows: a global batch of 16 gives 6 optimizer steps per epoch,
# the last one short (5 samples), so the tail's sample weighting is crossed too.
COMMON = ["--example", "housing", "--epochs", "2", "--progress", "plain", "--device", "cpu",
          "--data-size", "106"]
DDP = ["--strategy", "ddp"]


def _train_here(args: list[str]) -> Any:
    """One process, in this interpreter (the runner's result)."""
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.runner import train

    return train(config_from_argv([*COMMON, *args]))


def _ddp(args: list[str]) -> str:
    done = run_cli(["train", *COMMON, *DDP, *args])
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def _max_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between the final weights of runs ``a`` and ``b``."""
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    return max(float((x[k] - y[k]).abs().max()) for k in x)


def _same_weights(reference: Path, resumed: Path, label: str) -> None:
    diff = _max_difference(reference, resumed)
    print(f"{label}: max abs final-weight difference to the uninterrupted run {diff:.3g}")
    assert diff <= 1e-5, f"{label}: {diff}"
    x, y = load_file(reference / "model.safetensors"), load_file(resumed / "model.safetensors")
    for key in x:
        torch.testing.assert_close(x[key], y[key], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def two_procs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 2-process ddp run (2 x 8, global batch 16), saved every step."""
    out = tmp_path_factory.mktemp("world") / "two"
    _ddp(["--nproc", "2", "--batch-size", "8", "--save-every", "1", "--out", str(out)])
    return out


@pytest.mark.parametrize("step", [3, 6])  # mid-epoch; the first epoch's last step
def test_two_processes_resume_on_one(two_procs: Path, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str], step: int) -> None:
    out = tmp_path / "one"
    result = _train_here(["--strategy", "single", "--batch-size", "8", "--resume",
                          str(two_procs / "checkpoints" / f"step-{step:08d}"),
                          "--out", str(out)])
    err = capsys.readouterr().err
    # the change in one line: 2 x 8 x 1 then, 1 x 8 x accumulate 2 now
    lines = [x for x in err.splitlines() if "global batch 16" in x and "resuming on" in x]
    assert len(lines) == 1 and "2 x 8 x accumulate 1" in lines[0], err
    assert "1 x 8 x accumulate 2 now" in lines[0]
    assert result.config.accumulate == 2
    assert result.summary["steps"] == 12
    with capsys.disabled():
        _same_weights(two_procs, out, f"2 -> 1 processes from step {step}")


def test_one_process_resumes_on_two(tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    _train_here(["--strategy", "single", "--batch-size", "8", "--accumulate", "2",
                 "--save-every", "1", "--out", str(one)])
    capsys.readouterr()
    # the same command line with --nproc 2: the accumulation follows (16 = 2 x 8 x 1)
    err = _ddp(["--nproc", "2", "--batch-size", "8", "--accumulate", "2", "--resume",
                str(one / "checkpoints" / "step-00000004"), "--out", str(two)])
    assert "1 x 8 x accumulate 2 then, 2 x 8 x accumulate 1 now" in err, err
    with capsys.disabled():
        _same_weights(one, two, "1 -> 2 processes from step 4")


def test_four_processes_resume_on_two(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    four, two = tmp_path / "four", tmp_path / "two"
    _ddp(["--nproc", "4", "--batch-size", "4", "--save-every", "2", "--out", str(four)])
    err = _ddp(["--nproc", "2", "--batch-size", "4", "--resume",
                str(four / "checkpoints" / "step-00000004"), "--out", str(two)])
    assert "4 x 4 x accumulate 1 then, 2 x 4 x accumulate 2 now" in err, err
    with capsys.disabled():
        _same_weights(four, two, "4 -> 2 processes from step 4")


def test_a_world_that_cannot_keep_the_batch_is_refused(
        two_procs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "refused"
    code, err = run_main(["train", *COMMON, "--strategy", "single", "--batch-size", "6",
                          "--resume", str(two_procs / "checkpoints" / "step-00000003"),
                          "--out", str(out)], capsys)
    assert code == 2
    text = " ".join(err.split())
    assert "global batch of 16 samples per optimizer step" in text
    assert "2 process(es) x --batch-size 8 x --accumulate 1" in text
    assert "--batch-size 6" in text and "--batch-size 4" in text  # the value, a fix
    assert len([x for x in err.strip().splitlines() if x.strip()]) == 1  # one paragraph
    assert not out.exists()  # nothing written
    code, err = run_main(["train", *COMMON, "--strategy", "single", "--batch-size", "8",
                          "--effective-batch-size", "32", "--resume",
                          str(two_procs / "checkpoints" / "step-00000003"),
                          "--out", str(out)], capsys)
    assert code == 2 and "--effective-batch-size 16" in err and not out.exists()
