"""`torchgpu train --collate-fn SPEC --nproc 2`: every rank (and its DataLoader worker)
imports the collate spec and pads its own batches; the two gloo processes train the same
weights as one process with the global batch, an empty last batch on one rank included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import REPO, SRC, run_cli

SPECS = "tests.collate_models"
COMMON = ["--model", f"{SPECS}:classifier", "--data", f"{SPECS}:uneven_sentences",
          "--collate-fn", f"{SPECS}:padding", "--epochs", "2", "--lr", "0.05",
          "--device", "cpu", "--progress", "plain"]


@pytest.mark.slow
def test_ddp_with_a_collate_function_matches_one_process(tmp_path: Path) -> None:
    ddp_out, one_out = tmp_path / "ddp", tmp_path / "one"
    ddp = run_cli(["train", *COMMON, "--nproc", "2", "--strategy", "ddp", "--batch-size", "4",
                   "--num-workers", "1", "--out", str(ddp_out)], timeout=240, cwd=REPO,
                  PYTHONPATH=f"{SRC}:{REPO}")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.runner import train

    one = train(config_from_argv([*COMMON, "--batch-size", "8", "--out", str(one_out)]))
    a, b = load_file(ddp_out / "model.safetensors"), load_file(one_out / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-5)
    summary = json.loads((ddp_out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == one.summary["steps"] == 12
    assert summary["global_batch"] == one.summary["global_batch"] == 8
    assert summary["final"]["test_loss"] == pytest.approx(one.summary["final"]["test_loss"],
                                                          rel=1e-4)
