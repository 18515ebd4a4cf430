"""`torchgpu train --strategy fsdp` (FSDP2, 2 gloo processes on 127.0.0.1) with sharded
checkpoints: a run stopped by SIGTERM and continued with --autoresume, and a run whose
rank crashes and is restarted (--max-restarts), both with --async-save, end with the weights
of the uninterrupted run, bitwise; the checkpoints are sharded (every rank's shards, a
manifest), `ckpt verify` accepts them, `ckpt convert` gathers the last one into the final
model, and a damaged one named by --resume is one paragraph (exit 2)."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.distributed.proctree import Session
from tests.procs import HEAVY, run_cli

pytestmark = [pytest.mark.slow, HEAVY, pytest.mark.timeout(900)]

# 200 samples -> 160 train rows -> 10 micro-batches of 8 per rank per epoch; 10 epochs:
# the SIGTERM after the first save (step 5) was seen to stop the run at step 10 (also on
# a loaded machine), a fraction of a second later: the next agreement (about 0.5 s
# apart, ~12 steps), far from its end at step 100 (~4 s of steps on a quiet machine)
STEPS = 100
EPOCHS = ["--epochs", str(STEPS // 10)]
# a hang guard for one 100-step run (~15 s on a quiet 2-core machine), restarts included
RUN_S = 600.0
FLAGS = ["train", "--example", "housing", "--data-size", "200", "--batch-size", "8",
         "--progress", "off", "--device", "cpu", "--nproc", "2", "--strategy", "fsdp",
         "--save-every", "5"]


def _ckpt(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``torchgpu ckpt ARGS`` in this process (no child Python to start): (exit code,
    stdout); a traceback on stderr fails the test. The CLI's own process exit: test_ckpt_cli."""
    from torchgpu.cli.main import main

    capsys.readouterr()
    code = main(["ckpt", *args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err[-3000:]
    return code, out + err


def _same_weights(a: Path, b: Path) -> None:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert x.keys() == y.keys()
    for key in x:
        assert torch.equal(x[key], y[key]), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fsdp") / "full"
    done = run_cli([*FLAGS, *EPOCHS, "--out", str(out)], timeout=RUN_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_sigterm_then_autoresume_equals_the_uninterrupted_run(
        uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    with Session([*FLAGS, *EPOCHS, "--out", str(out), "--async-save"],
                 tmp_path) as run:
        run.wait_for(out / "checkpoints" / "latest")
        run.proc.send_signal(signal.SIGTERM)
        code = run.wait(120)
    err = run.stderr()
    assert not run.leftovers, run.leftovers
    assert code == 0 and "Traceback" not in err, err[-3000:]
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["stopped_early"] and stopped["stopped_at_step"] < STEPS, stopped
    step = stopped["stopped_at_step"]
    checkpoint = out / "checkpoints" / f"step-{step:08d}"
    assert (checkpoint / "shards" / ".metadata").is_file()
    assert len(list((checkpoint / "shards").glob("*.distcp"))) == 2  # one per rank
    code, said = _ckpt(["verify", str(out)], capsys)
    assert code == 0 and "sharded: 3 shard files" in said, said
    done = run_cli([*FLAGS, *EPOCHS, "--out", str(out), "--autoresume",
                    "--async-save"], timeout=RUN_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resuming from {checkpoint}" in done.stderr
    _same_weights(uninterrupted, out)


def test_a_crashed_rank_restarts_from_the_async_checkpoint_bitwise(
        uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Also: with a gather limit of 0 bytes the final model is written as every rank's
    shards (model-shards/, nothing gathered) and converts to the gathered model."""
    out = tmp_path / "run"
    done = run_cli([*FLAGS, *EPOCHS, "--out", str(out), "--max-restarts", "1",
                    "--async-save"], timeout=RUN_S,
                   TORCHGPU_FAULT_CRASH_AT_STEP="23", TORCHGPU_FAULT_MARKER=str(tmp_path / "m"),
                   TORCHGPU_FAULT_RANK="1", TORCHGPU_GATHER_LIMIT_BYTES="0")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "m").exists()  # it did crash, after step 23
    # from step 20, or 15 when the async save of step 20 was still being written
    assert re.search(r"resuming from \S*step-000000(20|15)", done.stderr), done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS
    assert not (out / "model.safetensors").exists()
    assert summary["files"]["model"] == str(out / "model-shards")
    assert len(list((out / "model-shards" / "shards").glob("*.distcp"))) == 2
    converted = tmp_path / "converted"
    converted.mkdir()
    code, said = _ckpt(["convert", str(out / "model-shards"),
                        str(converted / "model.safetensors")], capsys)
    assert code == 0, said[-2000:]
    _same_weights(uninterrupted, converted)


def test_the_last_checkpoint_converts_to_the_final_model(
        uninterrupted: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    last = uninterrupted / "checkpoints" / f"step-{STEPS:08d}"
    assert (uninterrupted / "checkpoints" / "latest").read_text().strip() == last.name
    flat = tmp_path / "model.safetensors"
    code, said = _ckpt(["convert", str(last), str(flat)], capsys)
    assert code == 0, said[-2000:]
    _same_weights(uninterrupted, tmp_path)


def test_a_damaged_sharded_checkpoint_named_by_resume_is_one_paragraph(
        uninterrupted: Path, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "run"
    shutil.copytree(uninterrupted, out)
    named = out / "checkpoints" / f"step-{STEPS:08d}"
    shard = sorted((named / "shards").glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    done = run_cli([*FLAGS, "--epochs", str(STEPS // 10 + 1), "--out", str(out), "--resume",
                    str(named)])
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert shard.name in done.stderr and "sha256" in done.stderr
