"""config.toml: the writer round-trips through tomllib, the reader checks names and types
and refuses fit()'s files, and the written settings are the ones that reproduce the run."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from torchgpu.errors import ConfigError, UsageError
from torchgpu.train.config import TrainConfig
from torchgpu.train.config_file import (
    CONFIG_FILE,
    dumps,
    read_settings,
    settings_to_write,
    write_config,
)

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the reader falls back to tomli)

TRICKY = ['plain', 'quote " inside', "back\\slash", "new\nline\ttab", "unicode é ✓",
          "control \x01 char", "C:\\path\\to\\file.py:attr", ""]


@pytest.mark.parametrize("text", TRICKY)
def test_strings_round_trip(text: str) -> None:
    assert tomllib.loads(dumps({"data": text}))["data"] == text


def test_numbers_bools_and_none_round_trip() -> None:
    values = {"epochs": 3, "lr": 0.1, "clip_norm": 1e-7, "big": 2**40, "neg": -5,
              "flag": True, "off": False, "third": 1 / 3, "skipped": None}
    loaded = tomllib.loads(dumps(values, run={"cli": True, "nothing": None},
                                 comments=("a comment", "another")))
    assert loaded.pop("run") == {"cli": True}
    assert loaded == {k: v for k, v in values.items() if v is not None}
    assert isinstance(loaded["lr"], float) and loaded["third"] == 1 / 3  # exact repr


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_read_settings_accepts_dashes_ints_for_floats_and_batch_auto(tmp_path: Path) -> None:
    path = _write(tmp_path, 'batch-size = "auto"\nlr = 1\nchunks = "auto"\nepochs = 2\n'
                  'activation_checkpointing = true\n[run]\ncli = true\n')
    settings = read_settings(path)
    assert settings == {"batch_size": "auto", "lr": 1.0, "chunks": "auto", "epochs": 2,
                        "activation_checkpointing": True}
    assert isinstance(settings["lr"], float)


@pytest.mark.parametrize(("text", "words"), [
    ("epoch = 2\n", ["unknown setting 'epoch'", "epochs"]),
    ('epochs = "2"\n', ['epochs = "2"', "an integer"]),  # the line as TOML writes it
    ("epochs = true\n", ["epochs = true", "an integer"]),
    ("resume = true\n", ["resume = true", 'resume = "" continues the run']),
    ("json = 1\n", ["json = 1", "true/false"]),
    ("lr = [1]\n", ["lr = [1]", "a number"]),
    ("epochs = \n", ["not valid TOML"]),
])
def test_bad_files_are_one_paragraph_config_errors(tmp_path: Path, text: str,
                                                    words: list[str]) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        read_settings(path)
    message = str(raised.value)
    assert path in message and "\n" not in message
    for word in words:
        assert word in message


def test_missing_file_and_fit_file_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        read_settings(str(tmp_path / "nope.toml"))
    path = _write(tmp_path, 'model = "fit:Net"\n[run]\ncli = false\n')
    with pytest.raises(UsageError, match=r"torchgpu\.fit"):
        read_settings(path)


def test_settings_to_write_makes_a_run_reproducible(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = TrainConfig(model="models/net.py:build", data="pkg.data:load", epochs=2,
                         batch_size=12, auto_batch_size=True, effective_batch_size=48,
                         resume="", trust_checkpoint=True, json=True, gpus="0,1",
                         out="runs/a")
    values = settings_to_write(config)
    assert values["model"] == f"{tmp_path}{os.sep}models{os.sep}net.py:build"
    assert values["data"] == "pkg.data:load"  # a module spec: resolved from the cwd
    assert values["auto_batch_size"] is False and values["effective_batch_size"] is None
    assert values["batch_size"] == 12  # the searched size that ran
    for name in ("resume", "trust_checkpoint", "json", "gpus", "progress"):
        assert name not in values
    csv = settings_to_write(TrainConfig(data="t.csv", target="y"), world_size=4,
                            local_world_size=2)
    assert csv["data"] == str(tmp_path / "t.csv")
    assert (csv["nproc"], csv["nnodes"]) == (2, 2)


def test_auto_values_and_file_specs_are_written_as_they_resolved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mse").write_text("")  # a file named like a built-in loss changes nothing
    config = TrainConfig(model="pkg.net:build", data="pkg.net:data", loss="mse",
                         precision="auto", out="runs/a")
    one = settings_to_write(config, device="cpu")
    assert (one["device"], one["precision"], one["loss"]) == ("cpu", "fp32", "mse")
    assert one["out"] == str(tmp_path / "runs" / "a")
    # several processes: a bare "cuda" is each rank's own GPU
    ddp = settings_to_write(dataclasses.replace(config, loss="losses/l1.py:l1"), world_size=2,
                            local_world_size=2, device="cuda:1")
    assert ddp["device"] == "cuda" and ddp["loss"] == f"{tmp_path / 'losses' / 'l1.py'}:l1"
    assert settings_to_write(config, device="cuda:0")["device"] == "cuda:0"
    named = dataclasses.replace(config, device="cuda")  # given, not auto: kept
    assert settings_to_write(named, device="cuda:0")["device"] == "cuda"


def test_a_split_models_measured_settings_are_written() -> None:
    """--chunks auto, --balance size|time and the default stage devices come from the
    wrapped model: what the sweep and the measurement chose."""
    import torch

    from torchgpu.parallel.pipeline import Pipeline

    layers = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(5)))
    pipe = Pipeline(layers, devices=["cpu", "cpu"], balance=[3, 2], chunks=3)
    config = TrainConfig(example="housing", strategy="pipeline", chunks="auto",
                         balance="time", precision="auto")
    values = settings_to_write(config, device="cpu", model=pipe)
    assert (values["chunks"], values["balance"], values["devices"]) == (3, "3,2", "cpu,cpu")
    assert values["device"] == "auto"  # --devices places the stages; --device stays out
    assert values["precision"] == "fp32"
    # no model known (the one-stage-per-process pipeline): kept as given
    assert settings_to_write(config, device="cpu")["chunks"] == "auto"


def test_written_file_reads_back_as_the_same_config(tmp_path: Path) -> None:
    config = TrainConfig(example="lenet", data_size=64, epochs=1, batch_size=8, lr=3e-4,
                         clip_norm=0.5, precision="bf16", chunks="auto", seed=7,
                         out=str(tmp_path), profile=2, log="tensorboard")
    path = write_config(tmp_path, config, world_size=1, local_world_size=1, device="cpu")
    assert path == tmp_path / CONFIG_FILE
    back = TrainConfig(**read_settings(str(path)))
    # device auto is written as the device the run used
    assert back == dataclasses.replace(config, progress="auto", device="cpu")


def test_fit_runs_write_a_file_that_says_it_cannot_be_rerun(tmp_path: Path) -> None:
    config = TrainConfig(model="fit:Net", data="fit:TensorDataset", epochs=1, out="x")
    path = write_config(tmp_path, config, world_size=1, local_world_size=1, device="cpu")
    text = path.read_text()
    assert "cannot re-run" in text and tomllib.loads(text)["run"]["cli"] is False
    with pytest.raises(UsageError, match="Python objects"):
        read_settings(str(path))


def test_fit_takes_the_new_settings_and_writes_config_toml(tmp_path: Path) -> None:
    import torch
    from torch.utils.data import TensorDataset

    from torchgpu import fit

    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    result = fit(torch.nn.Linear(3, 1), data, eval_data=data, loss=torch.nn.functional.mse_loss,
                 epochs=1, batch_size=8, device="cpu", out=tmp_path, progress="off",
                 profile=1, log="tensorboard", estimate_memory=True)
    text = (tmp_path / CONFIG_FILE).read_text()
    assert 'model = "fit:Linear"' in text and "profile = 1" in text
    assert tomllib.loads(text)["run"]["cli"] is False
    assert result.summary["profile"]["steps"] == 1
    assert result.summary["memory_estimate"]["source"] == "estimate_memory"
    assert (tmp_path / "tensorboard").is_dir()


@pytest.mark.parametrize(("text", "lines"), [
    ("batch_size = 4\nepochs = 1\nbatch-size = 12\n", (1, 3)),  # two spellings
    ("epochs = 1\n\nbatch-size = 4\n'batch_size' = 12\n[run]\ncli = true\n", (3, 4)),
    ("lr = 0.1\nlr = 0.2\n", (1, 2)),  # TOML itself rejects the exact repeat
])
def test_a_setting_given_twice_names_both_lines(tmp_path: Path, text: str,
                                                lines: tuple[int, int]) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        read_settings(path)
    message = str(raised.value)
    assert path in message and "\n" not in message and "twice" in message
    assert f"line {lines[0]} " in message and f"line {lines[1]} " in message


def test_a_key_like_line_inside_a_multiline_string_is_no_repeat(tmp_path: Path) -> None:
    path = _write(tmp_path, 'batch_size = 4\ndata = """\nbatch_size = 5\n"""\n')
    assert read_settings(path)["batch_size"] == 4


def test_a_utf8_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    """Editors on Windows write one; TOML forbids it, and it carries no setting."""
    path = tmp_path / "c.toml"
    path.write_bytes(b"\xef\xbb\xbfepochs = 2\nbatch-size = 8\n")
    assert read_settings(str(path)) == {"epochs": 2, "batch_size": 8}
