"""Every script in examples/ runs, at a tiny size (the DDP one under torchgpu launch)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests import procs
from tests.procs import REPO, run_cli

EXAMPLES = REPO / "examples"


def _run(name: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
        timeout=120, env=procs.test_env(), check=False,
    )


@pytest.mark.slow
def test_device_agnostic_housing_learns_on_cpu() -> None:
    done = _run("housing_device_agnostic.py", "--device", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    match = re.search(r"device cpu: test MSE [\d.]+, R² (-?[\d.]+)", done.stdout)
    assert match is not None and float(match.group(1)) >= 0.8


@pytest.mark.slow
def test_dataparallel_example_falls_back_with_a_note() -> None:
    done = _run("housing_dataparallel.py", "--epochs", "2", "--size", "120")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "falling back to one device" in done.stdout
    assert "test MSE" in done.stdout


@pytest.mark.slow
def test_ddp_example_under_launch() -> None:
    done = run_cli(["launch", "--nproc", "2", str(EXAMPLES / "housing_ddp.py"), "--epochs",
                    "2", "--size", "120"], timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("2 processes: test MSE") == 1  # rank 0 only


@pytest.mark.slow
def test_lenet_example_with_accumulation() -> None:
    done = _run("lenet.py", "--epochs", "1", "--size", "200", "--accumulate", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "epoch 0: test accuracy" in done.stdout and "fp32 on cpu" in done.stdout


def test_examples_are_short() -> None:
    for path in EXAMPLES.glob("*.py"):
        assert len(path.read_text().splitlines()) < 80, path.name
