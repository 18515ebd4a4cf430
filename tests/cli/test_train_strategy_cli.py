"""`torchgpu train` with the model/pipeline flags and the automatic choices: bad
combinations exit 2 with one paragraph and write nothing; `--strategy auto` logs its
decision; `--batch-size auto` finds the simulated limit; a model split trains and saves
the plain model's keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from torchgpu.cli.main import main
from torchgpu.models import HousingNet
from torchgpu.train.hooks.simulated_memory import SIMULATE_ENV

QUICK = ["--example", "housing", "--data-size", "80", "--epochs", "1", "--progress", "plain"]

BAD = [
    (["--strategy", "model", "--devices", "cpu"], "one device"),
    (["--strategy", "pipeline"], "--devices"),  # no GPUs here: the stages must be named
    (["--strategy", "ddp", "--devices", "cpu,cpu"], "--devices cpu,cpu"),
    (["--strategy", "model", "--devices", "cpu,cpu", "--nproc", "2"], "--nproc 2"),
    (["--strategy", "pipeline", "--devices", "cpu,cpu", "--schedule", "1f1b"], "--nproc"),
    (["--schedule", "gpipe"], "--schedule gpipe"),
    (["--strategy", "pipeline", "--nproc", "2", "--schedule", "1f1b", "--chunks", "1"],
     "--chunks 2"),
    (["--strategy", "model", "--devices", "cpu,cpu", "--balance", "3,3"], "3, 3"),
    (["--strategy", "model", "--devices", "cpu,cpu", "--balance", "even"], "even"),
    (["--strategy", "model", "--devices", "cuda:0,cuda:1"], "cuda:0"),
    (["--strategy", "model", "--devices", "cpu,cpu", "--chunks", "4"], "--chunks 4"),
    (["--chunks", "many"], "--chunks"),
    (["--batch-size", "auto", "--strategy", "fsdp"], "fsdp"),
    (["--batch-size", "16", "--effective-batch-size", "40"],
     "--effective-batch-size 40 is not a multiple of --batch-size 16"),
    (["--batch-size", "auto", "--effective-batch-size", "64", "--accumulate", "2"],
     "--accumulate"),
]


@pytest.mark.parametrize(("args", "needle"), BAD)
def test_bad_combinations_exit_2_without_writing(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:  # argparse errors exit; ours return
        raise SystemExit(main(["train", *QUICK, *args, "--out", str(out)]))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1  # one paragraph
    assert not out.exists()


def test_strategy_auto_logs_its_decision(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "--strategy auto: single (a one-sample probe bounds the step at" in err
    assert err.count("--strategy auto:") == 1
    assert json.loads((out / "summary.json").read_text())["strategy"] == "single"


def test_batch_size_auto_with_a_simulated_limit(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(SIMULATE_ENV, "13")
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--device", "cpu", "--batch-size", "auto",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    # 13 fit; the step keeps housing's default batch of 16 as 8 x 2 accumulation
    assert (summary["batch_size"], summary["accumulate"], summary["global_batch"]) == (8, 2, 16)
    err = capsys.readouterr().err
    assert "largest micro-batch that fits: 13 [probes: 16 OOM" in err
    assert "micro-batch 8 x 2 accumulation x 1 process(es) = 16 samples" in err


def test_batch_size_auto_keeps_the_default_batch_where_everything_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU nothing runs out of memory: auto must not grow the step to the whole
    dataset (it trained full-batch), only --effective-batch-size grows it."""
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--device", "cpu", "--batch-size", "auto",
                 "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["batch_size"], summary["accumulate"], summary["global_batch"]) == (16, 1, 16)
    assert "16 samples per optimizer step (batch 16 x 1 accumulation" in capsys.readouterr().err
    grown = tmp_path / "grown"
    assert main(["train", *QUICK, "--device", "cpu", "--batch-size", "auto",
                 "--effective-batch-size", "48", "--out", str(grown)]) == 0
    assert json.loads((grown / "summary.json").read_text())["global_batch"] == 48


def test_batch_size_auto_keeps_the_config_files_batch(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text("batch_size = 24\n")
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--device", "cpu", "--config", str(config),
                 "--batch-size", "auto", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["batch_size"], summary["global_batch"]) == (24, 24)


def test_model_split_on_cpu_pair_saves_plain_keys(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--strategy", "pipeline", "--devices", "cpu,cpu",
                 "--balance", "2,3", "--chunks", "4", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strategy"] == "pipeline"
    assert summary["config"]["devices"] == "cpu,cpu"
    HousingNet(13, out_dim=1).load_state_dict(load_file(out / "model.safetensors"), strict=True)
