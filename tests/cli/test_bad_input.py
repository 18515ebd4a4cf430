"""Bad input across the verbs: exit 2 with one paragraph naming the value and the fix,
never a traceback, nothing created, and nothing slow done first (data loading)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.procs import run_main

run = run_main  # torchgpu ARGV in this process: (exit code, stderr)


@pytest.fixture
def no_data_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run gets as far as loading its data (the housing example's,
    which these runs train)."""
    from torchgpu.examples import housing

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("data was loaded before the bad flag was refused")

    monkeypatch.setattr(housing, "load", refuse)


# --------------------------------------------------------------------------- --out
def bad_outs(tmp_path: Path) -> list[tuple[str, str]]:
    regular = tmp_path / "file.txt"
    regular.write_text("x")
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    cases = [
        (str(regular / "run"), "is a file, not a directory"),
        (str(regular / "deeper" / "run"), "is a file, not a directory"),
        (str(tmp_path / ("a" * 300)), f"at most {name_max} per name"),
        (str(tmp_path / "ok" / ("b" * 300) / "run"), "300 characters long"),
    ]
    if sys.platform.startswith("linux"):
        cases.append(("/proc/torchgpu-run", "no directory can be made in /proc"))
    return cases


def test_out_that_cannot_be_created_is_refused_before_data_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_data_loading: None
) -> None:
    cases = bad_outs(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    for out, needle in cases:
        code, err = run(["train", "--epochs", "1", "--out", out], capsys)
        assert code == 2, (out, err)
        assert needle in err and "--out" in err
        assert len(err.strip().splitlines()) == 1
        assert not os.path.exists(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing created


def test_out_check_leaves_nothing_behind(tmp_path: Path) -> None:
    from torchgpu.train.out_dir import check_creatable

    check_creatable(str(tmp_path / "new" / "run"))
    check_creatable(str(tmp_path))  # existing and writable
    assert list(tmp_path.iterdir()) == []


def test_library_train_checks_out_before_loading(
    tmp_path: Path, no_data_loading: None
) -> None:
    from torchgpu.errors import UsageError
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.runner import train

    regular = tmp_path / "file.txt"
    regular.write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        train(TrainConfig(epochs=1, out=str(regular / "run")))


# ------------------------------------------------------------------- numbers, train
@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--seed", "-1"], "--seed -1 is out of range"),
        (["--seed", str(2**70)], "2**63-1"),
        (["--batch-size", str(2**63)], f"--batch-size {2**63} is out of range"),
        (["--gpus", "0,,1"], "--gpus '0,,1' is not a GPU list"),
        (["--num-workers", "100000"], "--num-workers 100000"),
    ],
)
def test_train_numbers_out_of_range(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    no_data_loading: None,
) -> None:
    out = tmp_path / "out"
    code, err = run(["train", *args, "--out", str(out)], capsys)
    assert code == 2 and needle in err, err
    assert "CUDA_VISIBLE_DEVICES" not in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_cpu_nproc_is_capped_by_the_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    nproc = 4 * (os.cpu_count() or 1) + 1
    code, err = run(["train", "--device", "cpu", "--data-size", "60", "--batch-size", "4",
                     "--nproc", str(nproc), "--out", str(out)], capsys)
    assert code == 2
    assert f"--nproc {nproc} would start {nproc} CPU processes on {os.cpu_count()} cores" in err
    assert not out.exists()


@pytest.mark.parametrize("example", ["housing", "lenet", "resnet50"])
def test_example_batch_larger_than_its_train_split_is_refused(
    example: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    code, err = run(["train", "--example", example, "--data-size", "40", "--batch-size", "1000",
                     "--epochs", "1", "--out", str(out)], capsys)
    assert code == 2
    assert f"example {example} has 40 samples" in err and "fewer than one batch of 1000" in err
    assert "--batch-size" in err
    assert not out.exists()


def test_csv_with_semicolons_is_named_on_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = tmp_path / "table.csv"
    table.write_text("a;b;y\n" + "".join(f"{i};{i + 1};{i * 2}\n" for i in range(50)))
    code, err = run(["train", "--data", str(table), "--target", "y", "--out",
                     str(tmp_path / "out")], capsys)
    assert code == 2 and "semicolon-separated" in err and "encode categories" not in err


# --------------------------------------------------------------- select and plan
@pytest.mark.parametrize("value", ["-1GiB", "-1", "-0.5MB"])
def test_select_negative_size_is_a_size_error(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(["select", "--min-free", value], capsys)
    assert code == 2
    assert f"size {value!r} is negative: a size must be >= 0" in err
    assert "expected one argument" not in err


def test_select_size_beyond_int64(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["select", "--min-free", "9" * 400], capsys)
    assert code == 2 and "out of range" in err


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--batch-size", str(2**63)], "is out of range: it must be <= 2147483648"),
        (["--devices", "-1xGiB"], "--devices '-1xGiB' is not understood"),
    ],
)
def test_plan_bad_numbers(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["plan", *args], capsys)
    assert code == 2 and needle in err, err


def test_launch_nproc_is_capped_by_the_cores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "s.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    code, err = run(["launch", "--nproc", "1000", str(script)], capsys)
    assert code == 2
    assert f"--nproc 1000 would start 1000 processes on {os.cpu_count()} cores" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s.py.ran").exists()


@pytest.mark.timeout(120)  # far below the hours a plan over so many devices would take
def test_plan_with_a_huge_device_count_is_refused_at_once(
    capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run(["plan", "--example", "resnet50", "--devices", "99999999999x80GiB"], capsys)
    assert code == 2
    assert "99999999999x80GiB" in err and "at most 1024" in err


@pytest.mark.parametrize("name", ["summary.json", "metrics.jsonl", "loss.png",
                                  "model.safetensors", "config.toml", "checkpoints",
                                  "tensorboard", "profile.txt", "profile.trace.json"])
def test_something_in_the_way_of_an_output_file_is_refused_before_training(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        no_data_loading: None) -> None:
    """Where the run writes a file, a directory (and where it keeps checkpoints, a file)
    would fail only after all the training: it is refused first, naming it."""
    out = tmp_path / "run"
    out.mkdir()
    if name in ("checkpoints", "tensorboard"):
        (out / name).write_text("x")
    else:
        (out / name / "inside").mkdir(parents=True)
    code, err = run(["train", "--epochs", "1", "--out", str(out)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{name} there is a" in err and "Move" in err
    assert sorted(p.name for p in out.iterdir()) == [name]


@pytest.mark.parametrize("write", ["json", "plot", "config", "model"])
def test_an_output_write_that_fails_is_one_paragraph_and_commits_nothing(
        write: str, tmp_path: Path) -> None:
    """A file that cannot be written at the end of a run (something put in its place
    meanwhile) is a CheckpointWriteError naming it and why, with nothing half-written."""
    from torchgpu.errors import CheckpointWriteError
    from torchgpu.train.config import TrainConfig
    from torchgpu.train.config_file import write_config
    from torchgpu.train.outputs import files as outputs

    target = {"json": "summary.json", "plot": "loss.png", "config": "config.toml",
              "model": "model.safetensors"}[write]
    (tmp_path / target / "inside").mkdir(parents=True)
    with pytest.raises(CheckpointWriteError) as caught:
        if write == "json":
            outputs.write_json(tmp_path / target, {"a": 1})
        elif write == "plot":
            record = outputs.EpochRecord(epoch=0, step=1, train_loss=1.0, test_loss=2.0,
                                          samples_per_s=1.0, seconds=1.0)
            outputs.plot_losses(tmp_path / target, [record], "t")
        elif write == "config":
            write_config(tmp_path, TrainConfig(epochs=1), world_size=1, local_world_size=1,
                         device="cpu")
        else:
            import torch

            outputs.save_model(tmp_path / target, {"w": torch.zeros(2)})
    message = str(caught.value)
    assert target in message and "is a directory, not a file" in message
    assert "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == [target]  # no temporary left


@pytest.mark.parametrize(("argv", "needle"), [
    (["plan", "--model", "torch.nn:Identity", "--input-shape", "-1,4"], "--input-shape '-1,4'"),
    (["doctor", "--model", "torch.nn:Identity", "--input-shape", "-2,3"], "--input-shape '-2,3'"),
    (["select", "--min-free", "-1GiB"], "is negative"),
    (["train", "--profile", "-1"], "--profile -1 is out of range"),
    (["train", "--collective-timeout", "-.5"], "--collective-timeout -0.5"),
    (["train", "--startup-timeout", "-1"], "--startup-timeout -1 is out of range"),
    (["train", "--stop-timeout", "0"], "--stop-timeout 0 is out of range"),
    (["train", "--stop-timeout", "nan"], "--stop-timeout nan is out of range"),
])
def test_a_value_that_looks_negative_reaches_its_flags_check(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse takes ``-1,4`` for an option ("expected one argument"); every verb's
    parser hands it to the flag, whose check names what is wrong."""
    code, err = run(argv, capsys)
    assert code == 2 and needle in err, err
    assert "expected one argument" not in err
