"""`torchgpu train --nproc 2 --strategy ddp` on CPU: two gloo processes train the same
weights as one process with the same global batch, also when the training set does not
split evenly over the ranks (unpadded shards, losses weighted by samples), and only
rank 0 writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import run_cli

COMMON = ["--example", "housing", "--epochs", "2", "--progress", "plain", "--device", "cpu"]


# data size -> training rows: 106 -> 85 (rank 0 holds 43, rank 1 42: the last global
# batch of 5 is 3 + 2); 101 -> 81 with 2 micro-batches per step (the last global batch
# has 1 sample: rank 1's last batch is empty, and the last window is 16 + 1 samples).
@pytest.mark.slow
# The second also runs a cosine LR schedule with warm-up: it steps alike on every rank,
# over the optimizer steps of the global batch.
@pytest.mark.parametrize(("size", "extra"), [
    ("106", []),
    ("101", ["--accumulate", "2", "--lr-schedule", "cosine", "--warmup-steps", "2"])])
def test_ddp_two_processes_match_one_process_with_the_global_batch(
    tmp_path: Path, size: str, extra: list[str],
) -> None:
    ddp_out, one_out = tmp_path / "ddp", tmp_path / "one"
    common = [*COMMON, "--data-size", size, *extra]
    ddp = run_cli(["train", *common, "--nproc", "2", "--strategy", "ddp", "--batch-size", "8",
                   "--out", str(ddp_out)])
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.runner import train

    one = train(config_from_argv([*common, "--batch-size", "16", "--out", str(one_out)]))
    assert one.state.samples // 2 % 2 == 1  # 2 epochs of rows that do not split evenly
    assert ddp.stdout.count("trained housing (ddp, 2 process(es)") == 1  # rank 0 only
    a = load_file(ddp_out / "model.safetensors")
    b = load_file(one_out / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)
    summary = json.loads((ddp_out / "summary.json").read_text())
    assert summary["steps"] == one.summary["steps"]
    assert summary["strategy"] == "ddp" and summary["world_size"] == 2
    assert summary["global_batch"] == one.summary["global_batch"]
    assert len(summary["devices"]) == 2
    # The logged loss is the global batch's (mean over ranks), as in the one-process run.
    ddp_steps = [json.loads(x) for x in (ddp_out / "metrics.jsonl").read_text().splitlines()]
    one_steps = [json.loads(x) for x in (one_out / "metrics.jsonl").read_text().splitlines()]
    assert [x["kind"] for x in ddp_steps] == [x["kind"] for x in one_steps]
    for x, y in zip(ddp_steps, one_steps, strict=True):
        if x["kind"] == "step":
            assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
            assert x["lr"] == y["lr"]
        else:  # each global batch's loss counted once, as one process counts it
            assert x["train_loss"] == pytest.approx(y["train_loss"], rel=1e-4)
    assert sorted(p.name for p in ddp_out.iterdir()) == [
        "config.toml", "loss.png", "metrics.jsonl", "model.safetensors", "summary.json"]
