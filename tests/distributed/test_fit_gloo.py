"""torchgpu.fit under `torchgpu launch --nproc 2` (two gloo processes on 127.0.0.1) trains
DDP with no code change and ends with the weights of one process at the same global
batch, also when the last batch does not split evenly over the ranks or leaves one rank
with no rows (a zero-row dict batch through the model)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.procs import REPO, run_cli, run_script_here

SCRIPT = REPO / "tests" / "distributed" / "fit_lm_script.py"


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """The script run alone (batch 8) on ``samples`` rows, once per module and row count,
    in this process: the reference of the two-process runs below (its output directory)."""
    runs: dict[int, Path] = {}

    def run(samples: int) -> Path:
        if samples not in runs:
            out = tmp_path_factory.mktemp(f"one-{samples}") / "one"
            printed = run_script_here(SCRIPT, [str(out), "8", f"samples={samples}"])
            assert "strategy single world 1 models built 1" in printed, printed
            runs[samples] = out
        return runs[samples]

    return run


# One xdist worker for the tests sharing the one-process reference of 44 rows.
ONE_PROCESS = pytest.mark.xdist_group("fit-lm-one-process")


@pytest.mark.slow
@ONE_PROCESS
@pytest.mark.parametrize("samples", [44, 41])  # 41: rank 1's share of the last batch is empty
def test_two_processes_equal_one(tmp_path: Path, samples: int,
                                 one_process: Callable[[int], Path]) -> None:
    one = one_process(samples)
    two = run_cli(["launch", "--nproc", "2", str(SCRIPT), str(tmp_path / "two"), "4",
                   f"samples={samples}"],
                  timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("strategy ddp world 2 models built 1") == 2  # once per process
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["global_batch"] == 8 and summary["world_size"] == 2
    a = load_file(one / "model.safetensors")
    b = load_file(tmp_path / "two" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
@ONE_PROCESS
def test_fsdp_on_the_tied_lm_equals_one_process(tmp_path: Path,
                                                one_process: Callable[[int], Path]) -> None:
    """The test LM ties its head to the token embedding: under fsdp on 2 processes the tied
    blocks are sharded as one unit, and the run trains, saves the tie once and ends with
    one process's weights at the same global batch."""
    one = one_process(44)  # the script's default row count
    two = run_cli(["launch", "--nproc", "2", str(SCRIPT), str(tmp_path / "two"), "4",
                   "strategy=fsdp"], timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("strategy fsdp world 2 models built 1") == 2
    a = load_file(one / "model.safetensors")
    b = load_file(tmp_path / "two" / "model.safetensors")
    assert "head.weight" not in b and a.keys() == b.keys()  # the tie is stored once
    with safe_open(tmp_path / "two" / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["torchgpu.aliases"]) == {"head.weight": "embed.weight"}
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["strategy"] == "fsdp" and summary["global_batch"] == 8


@pytest.mark.slow
def test_ten_fits_in_one_launched_script(tmp_path: Path) -> None:
    """A script that calls fit ten times under `torchgpu launch --nproc 2`: every run trains
    on both processes, none hangs (the process group formed by the first fit is kept for
    the process's life; forming it again met the old group's keys in torchrun's store)."""
    from tests.distributed.proctree import Session

    script = REPO / "tests" / "distributed" / "faulty_fit_script.py"
    args = ["launch", "--nproc", "2", str(script), str(tmp_path / "runs"), "runs=10",
            "epochs=1", "collective_timeout=60"]
    with Session(args, tmp_path, FAULTY_ROWS="16") as run:
        code = run.wait(240)
    assert not run.leftovers, f"processes left running: {run.leftovers}"
    assert code == 0, run.stderr()[-3000:]
    for i in range(10):
        assert run.stdout().count(f"fit {i} done: world 2") == 2, run.stdout()[-3000:]
        assert json.loads((tmp_path / "runs" / f"run-{i}" / "summary.json").read_text())[
            "world_size"] == 2
