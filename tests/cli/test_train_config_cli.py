"""`torchgpu train --config FILE.toml`: flags override the file, bad files exit 2, and a
run reproduced from its own OUT/config.toml is bitwise equal on CPU (built-in example,
CSV table, a user's model from a file spec given as a relative path)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.procs import REPO
from torchgpu.cli.main import main
from torchgpu.cli.train_flags import config_from_argv
from torchgpu.train.config_file import read_settings


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


def _reproduced(first: Path, second: Path, capsys: pytest.CaptureFixture[str],
                resolved: tuple[str, ...] = ("device",)) -> None:
    """``second`` run from ``first``'s config.toml equals it bitwise. ``resolved``: the
    settings ``first`` gave as ``auto`` and its config.toml holds as they resolved."""
    assert main(["train", "--config", str(first / "config.toml"), "--out", str(second),
                 "--progress", "off"]) == 0, capsys.readouterr().err
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors"
                                                          ).read_bytes()
    assert _losses(first) == _losses(second)
    one, two = (json.loads((d / "summary.json").read_text()) for d in (first, second))
    assert one["final"] == two["final"] and one["steps"] == two["steps"]
    # The same settings; paths (out, CSV files, file specs) are written absolute.
    paths = ("out", "progress", "data", "model", "loss", *resolved)
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


USER_FILES = {
    "net.py": "import torch\n"
              "def build():\n"
              "    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.ReLU(),\n"
              "                               torch.nn.Linear(8, 1))\n"
              "def data():\n"
              "    g = torch.Generator().manual_seed(0)\n"
              "    x = torch.randn(64, 3, generator=g)\n"
              "    ds = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))\n"
              "    return ds, ds\n",
    "losses/l1.py": "import torch\n"
                    "def l1(output, target):\n"
                    "    return torch.nn.functional.l1_loss(output, target)\n",
}


def test_relative_file_specs_model_data_and_loss_reproduced_from_elsewhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file spec (--model, --data and --loss) and --out are written absolute, so the
    file reproduces the run from any directory."""
    work = tmp_path / "work"
    for name, text in USER_FILES.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    monkeypatch.chdir(work)
    assert main(["train", "--model", "net.py:build", "--data", "net.py:data", "--loss",
                 "losses/l1.py:l1", "--epochs", "2", "--batch-size", "16", "--out", "a",
                 "--progress", "off"]) == 0
    settings = read_settings(str(work / "a" / "config.toml"))
    assert settings["loss"] == f"{work / 'losses' / 'l1.py'}:l1"
    assert settings["out"] == str(work / "a")
    monkeypatch.chdir(tmp_path)
    _reproduced(work / "a", tmp_path / "b", capsys)


def test_auto_settings_are_written_as_they_resolved_and_reproduce_bitwise(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--chunks auto (a timed split-size sweep), --balance time (timed layers),
    --precision auto and --device auto are written as the run resolved them, so the
    reproduction runs the same micro-batches and stages instead of measuring again."""
    first = tmp_path / "a"
    assert main(["train", "--example", "housing", "--data-size", "120", "--epochs", "2",
                 "--batch-size", "12", "--strategy", "pipeline", "--devices", "cpu,cpu",
                 "--chunks", "auto", "--balance", "time", "--precision", "auto",
                 "--out", str(first), "--progress", "off"]) == 0
    chosen = re.search(r"chose --chunks (\d+)", capsys.readouterr().err)
    assert chosen is not None
    settings = read_settings(str(first / "config.toml"))
    assert settings["chunks"] == int(chosen[1])
    assert re.fullmatch(r"[1-9]\d*,[1-9]\d*", settings["balance"]), settings["balance"]
    assert settings["precision"] == "fp32" and settings["devices"] == "cpu,cpu"
    assert settings["device"] == "auto"  # --devices places the stages
    _reproduced(first, tmp_path / "b", capsys,
                resolved=("chunks", "balance", "precision", "device"))
    # a one-device run: the device auto chose
    single = tmp_path / "c"
    assert main(["train", "--example", "housing", "--data-size", "40", "--epochs", "1",
                 "--out", str(single), "--progress", "off"]) == 0
    assert read_settings(str(single / "config.toml"))["device"] == "cpu"


def test_a_resume_refused_for_changed_settings_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The checkpoint's saved settings are checked before --out is made: a refused run
    leaves no directory and no config.toml behind (nor in the run it resumes)."""
    first = tmp_path / "a"
    assert main(["train", "--example", "housing", "--data-size", "40", "--epochs", "1",
                 "--save-every", "1", "--out", str(first), "--progress", "off"]) == 0
    before = sorted(p.name for p in first.iterdir())
    capsys.readouterr()
    other = tmp_path / "c"
    assert main(["train", "--example", "housing", "--data-size", "40", "--epochs", "1",
                 "--resume", str(first), "--lr", "0.005", "--out", str(other),
                 "--progress", "off"]) == 2
    err = capsys.readouterr().err
    assert "cannot resume from" in err and "lr 0.01 -> 0.005" in err, err
    assert not other.exists()
    assert main(["train", "--example", "housing", "--data-size", "40", "--epochs", "1",
                 "--resume", "--out", str(first), "--seed", "4", "--progress", "off"]) == 2
    assert "seed 0 -> 4" in capsys.readouterr().err
    assert sorted(p.name for p in first.iterdir()) == before


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('example = "lenet"\nepochs = 4\nbatch_size = "auto"\nlr = 0.5\n'
                    'activation_checkpointing = true\n')
    config = config_from_argv(["--config", str(path), "--epochs", "1", "--lr", "0.1"])
    assert (config.example, config.epochs, config.lr) == ("lenet", 1, 0.1)
    assert config.activation_checkpointing and config.auto_batch_size
    assert config.batch_size is None
    assert config_from_argv(["--config", str(path), "--batch-size", "32"]).batch_size == 32


def test_settings_a_file_turns_on_can_be_turned_off_on_the_command_line(
        tmp_path: Path) -> None:
    """--no-NAME puts a setting back to its default: switches (BooleanOptionalAction) and
    optional values alike."""
    from torchgpu.train.config_checks import validate

    path = tmp_path / "c.toml"
    path.write_text("profile = 3\nsave_every = 5\nkeep_last = 2\nclip_norm = 1.0\n"
                    "estimate_memory = true\nactivation_checkpointing = true\n")
    on = config_from_argv(["--config", str(path)])
    assert (on.profile, on.save_every, on.keep_last, on.clip_norm) == (3, 5, 2, 1.0)
    off = config_from_argv(["--config", str(path), "--no-profile", "--no-save-every",
                            "--no-keep-last", "--no-clip-norm", "--no-estimate-memory",
                            "--no-activation-checkpointing"])
    assert (off.profile, off.save_every, off.keep_last, off.clip_norm) == (None,) * 4
    assert not off.estimate_memory and not off.activation_checkpointing
    validate(off)
    assert config_from_argv(["--json", "--no-json"]).json is False


def test_a_bad_value_from_the_file_is_named_as_the_files_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text('epochs = 0\ndata-size = 0\ncollective_timeout = 1e15\n')
    out = tmp_path / "out"
    assert main(["train", "--config", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: epochs = 0 is out of range" in err and "--epochs" not in err
    # given on the command line too: the flag is what is wrong
    assert main(["train", "--config", str(path), "--epochs", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "torchgpu: --epochs 0 is out of range" in err and "--config" not in err
    assert main(["train", "--config", str(path), "--epochs", "1", "--data-size", "10",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--config {path}: collective_timeout = 1000000000000000.0 is out of range" in err
    assert "e.g. collective_timeout = 300" in err and "--collective-timeout" not in err
    assert not out.exists()


@pytest.mark.parametrize(("text", "needle"), [
    ("epochs = 0\n", "epochs = 0 is out of range"),  # validated like the flag
    ("epoch = 2\n", "unknown setting"),
    ('strategy = "zero3"\n', "zero3"),
    ('model = "fit:Net"\n[run]\ncli = false\n', "torchgpu.fit"),
    ("batch_size = 4\nbatch-size = 12\n", "line 1 (batch_size = ...) and line 2"),
    ("\ufeffepochs = 0\n", "epochs = 0 is out of range"),  # a BOM is no error itself
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


def test_a_resume_refused_for_another_data_size_keeps_the_runs_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A resume refused when the checkpoint is opened (the epoch's length differs) leaves
    every file of the run as it was, config.toml included."""
    first = tmp_path / "a"
    assert main(["train", "--example", "housing", "--data-size", "40", "--epochs", "1",
                 "--batch-size", "8", "--save-every", "2", "--out", str(first),
                 "--progress", "off"]) == 0
    before = {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["train", "--example", "housing", "--epochs", "2", "--batch-size", "8",
                 "--resume", "--out", str(first), "--progress", "off"]) == 2
    assert "batches_per_epoch" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == before
