"""`torchgpu train --model SPEC --data SPEC [--loss ...]`: a user's causal LM (dict batches,
the model's own .loss, tied embeddings) and a BatchNorm CNN with a named loss, trained
from the command line; bad specs exit 2 with one paragraph and write nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.procs import REPO, run_cli, run_main

MODELS = "tests.user_models"


def _train(out: Path, *args: str, timeout: float = 180):  # type: ignore[no-untyped-def]
    return run_cli(["train", *args, "--out", str(out), "--progress", "plain"],
                   timeout=timeout, cwd=REPO, PYTHONPATH=str(REPO))


@pytest.mark.slow
def test_causal_lm_from_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "lm"
    done = _train(out, "--model", f"{MODELS}:lm_factory", "--data", f"{MODELS}:lm_data",
                  "--epochs", "2", "--batch-size", "8")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"] == "lm_factory" and summary["steps"] == 16
    assert summary["batch_size"] == 8 and summary["global_batch"] == 8
    assert summary["final"]["train_loss"] is not None and summary["final"]["test_loss"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"step"' in line and '"kind": "step"' in line]
    assert len(steps) == 16 and steps[-1]["loss"] < steps[0]["loss"]
    state = load_file(out / "model.safetensors")
    assert "embed.weight" in state and "head.weight" not in state  # tied: stored once
    assert (out / "loss.png").is_file()
    from tests.user_models import TinyCausalLM
    from torchgpu import load_state_dict

    fresh = TinyCausalLM()
    load_state_dict(fresh, out / "model.safetensors")
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, state["embed.weight"])


@pytest.mark.slow
def test_cnn_with_batchnorm_and_a_named_loss_from_a_file_spec(tmp_path: Path) -> None:
    out = tmp_path / "cnn"
    spec = REPO / "tests" / "user_models.py"
    done = _train(out, "--model", f"{spec}:cnn_factory", "--data", f"{spec}:cnn_data",
                  "--loss", "cross_entropy", "--epochs", "1", "--batch-size", "16",
                  "--accumulate", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["global_batch"] == 32


@pytest.mark.parametrize(("args", "words"), [
    (["--model", f"{MODELS}:nope", "--data", f"{MODELS}:lm_data"], "no attribute 'nope'"),
    (["--model", f"{MODELS}:lm_factory", "--data", f"{MODELS}:not_a_dataset"],
     "not a Dataset"),
    (["--model", f"{MODELS}:cnn_factory", "--data", f"{MODELS}:cnn_data"], "no loss"),
    (["--model", f"{MODELS}:lm_factory"], "needs --data"),
    (["--model", f"{MODELS}:lm_factory", "--data", "lm_data"], "not a spec"),
    (["--model", f"{MODELS}:lm_factory", "--data", f"{MODELS}:lm_data", "--example",
      "housing"], "not both"),
    (["--loss", "mse"], "without --model"),
    (["--model", f"{MODELS}:cnn_factory", "--data", f"{MODELS}:cnn_data", "--loss", "hinge"],
     "not a built-in loss"),
    # found by the probe (one forward and loss) before --out exists
    (["--model", f"{MODELS}:CNNDictWrapper", "--data", f"{MODELS}:cnn_dict_data"],
     "no scalar loss"),
    (["--model", f"{MODELS}:lm_factory", "--data", f"{MODELS}:cnn_data", "--loss",
      "cross_entropy"], f"--model {MODELS}:lm_factory on two samples of --data"),
    (["--model", f"{MODELS}:CNNDictWrapper", "--data", f"{MODELS}:cnn_dict_data", "--loss",
      "cross_entropy"], "dict batches, which have no separate target"),
])
def test_bad_specs_exit_2_and_write_nothing(tmp_path: Path, args: list[str], words: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    # in this process (run_main: the CLI's main, no traceback allowed); a child process's
    # own exit 2 without a traceback: tests/cli/test_train_cli.py
    out = tmp_path / "run"
    code, err = run_main(["train", *args, "--out", str(out), "--progress", "plain"], capsys)
    assert code == 2, err[-2000:]
    assert words in err
    assert not out.exists()


@pytest.mark.slow
def test_nproc_2_relaunch_builds_from_the_specs_and_equals_one_process(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", f"{MODELS}:lm_factory_no_dropout", "--data", f"{MODELS}:lm_data",
              "--epochs", "1"]
    # the one-process reference in this process (no start-up of its own)
    code, err = run_main(["train", *common, "--batch-size", "8", "--out", str(tmp_path / "one"),
                          "--progress", "plain"], capsys)
    assert code == 0, err[-3000:]
    two = _train(tmp_path / "two", *common, "--batch-size", "4", "--nproc", "2",
                 "--strategy", "ddp", timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 8
    def losses(run: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text()
                .splitlines() if '"kind": "step"' in line]

    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)
    a = load_file(tmp_path / "one" / "model.safetensors")
    b = load_file(tmp_path / "two" / "model.safetensors")
    for key in a:
        if key.endswith("in_proj_bias"):
            # Its key part has a true gradient of zero (softmax ignores a shift of every
            # score), so AdamW turns float rounding there into lr-sized steps.
            continue
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def test_a_module_spec_is_found_in_the_working_directory(tmp_path: Path) -> None:
    package = tmp_path / "proj" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text((REPO / "tests" / "user_models.py").read_text())
    done = run_cli(["train", "--model", "mypkg.models:lm_factory", "--data",
                    "mypkg.models:lm_data", "--epochs", "1", "--out", str(tmp_path / "run")],
                   timeout=120, cwd=tmp_path / "proj")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").is_file()
