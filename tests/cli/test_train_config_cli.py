"""`torchgpu train --config FILE.toml`: flags override the file, bad files exit 2, and a
run reproduced from its own OUT/config.toml is bitwise equal on CPU (built-in example,
CSV table, a user's model from a file spec given as a relative path)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.procs import REPO
from torchgpu.cli.main import main
from torchgpu.cli.train import config_from_argv


def _losses(out: Path) -> tuple[list[object], list[object]]:
    steps, epochs = [], []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "step":
            steps.append((record["step"], record["epoch"], record["loss"]))
        else:  # time-free fields of the epoch record
            epochs.append({k: v for k, v in record.items()
                           if k not in ("seconds", "samples_per_s")})
    return steps, epochs


def _reproduced(first: Path, second: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--config", str(first / "config.toml"), "--out", str(second),
                 "--progress", "off"]) == 0, capsys.readouterr().err
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors"
                                                          ).read_bytes()
    assert _losses(first) == _losses(second)
    one, two = (json.loads((d / "summary.json").read_text()) for d in (first, second))
    assert one["final"] == two["final"] and one["steps"] == two["steps"]
    # The same settings; paths (out, CSV files, file specs) are written absolute.
    paths = ("out", "progress", "data", "model")
    assert {k: v for k, v in one["config"].items() if k not in paths} == {
        k: v for k, v in two["config"].items() if k not in paths}


def test_example_run_reproduced_bitwise(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    first = tmp_path / "a"
    assert main(["train", "--example", "housing", "--data-size", "120", "--epochs", "2",
                 "--device", "cpu", "--seed", "3", "--lr", "0.02", "--out", str(first),
                 "--progress", "off"]) == 0
    _reproduced(first, tmp_path / "b", capsys)


def test_csv_run_reproduced_bitwise_from_another_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    rows = ["a,b,y"] + [f"{i % 7},{(i * 3) % 5},{i % 7 + 2 * ((i * 3) % 5)}" for i in range(60)]
    work = tmp_path / "work"
    work.mkdir()
    (work / "t.csv").write_text("\n".join(rows) + "\n")
    monkeypatch.chdir(work)
    assert main(["train", "--data", "t.csv", "--target", "y", "--epochs", "2",
                 "--batch-size", "8", "--out", "a", "--progress", "off"]) == 0
    monkeypatch.chdir(tmp_path)  # the relative CSV path was written absolute
    _reproduced(work / "a", tmp_path / "b", capsys)


def test_user_model_file_spec_reproduced_bitwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    spec = "tests/user_models.py"
    first = tmp_path / "a"
    assert main(["train", "--model", f"{spec}:cnn_factory", "--data", f"{spec}:cnn_data",
                 "--loss", "cross_entropy", "--epochs", "1", "--batch-size", "16",
                 "--accumulate", "2", "--out", str(first), "--progress", "off"]) == 0
    monkeypatch.chdir(tmp_path)
    _reproduced(first, tmp_path / "b", capsys)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('example = "lenet"\nepochs = 4\nbatch_size = "auto"\nlr = 0.5\n'
                    'activation_checkpointing = true\n')
    config = config_from_argv(["--config", str(path), "--epochs", "1", "--lr", "0.1"])
    assert (config.example, config.epochs, config.lr) == ("lenet", 1, 0.1)
    assert config.activation_checkpointing and config.auto_batch_size
    assert config.batch_size is None
    assert config_from_argv(["--config", str(path), "--batch-size", "32"]).batch_size == 32


@pytest.mark.parametrize(("text", "needle"), [
    ("epochs = 0\n", "--epochs 0"),  # validated like the flag
    ("epoch = 2\n", "unknown setting"),
    ('strategy = "zero3"\n', "zero3"),
    ('model = "fit:Net"\n[run]\ncli = false\n', "torchgpu.fit"),
])
def test_bad_config_exits_2_without_writing(tmp_path: Path, text: str, needle: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
