"""`torchgpu plan`'s `run:` line runs as printed: with `--model --data` it carries the
`--loss` that data of (inputs, target) pairs needs (and the `--optimizer` planned, when
one was asked for); where no `torchgpu train` line would run, none is printed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from tests.procs import run_main
from torchgpu.cli.main import main

MODELS = "tests.user_models"


def plan(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", *argv, "--devices", "1x1GiB"])
    out, err = capsys.readouterr()
    return code, out, err


def run_line(out: str) -> list[str]:
    """The printed `run:` command as argv (one line: the console does not wrap it)."""
    line = next(x for x in out.splitlines() if x.startswith("run:"))
    return shlex.split(line.removeprefix("run:").strip())


def test_the_run_line_of_a_model_on_pairs_trains_as_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, "--model", f"{MODELS}:cnn_factory", "--data",
                          f"{MODELS}:cnn_data", "--loss", "cross_entropy")
    assert code == 0, err
    argv = run_line(out)
    assert argv[:2] == ["torchgpu", "train"]
    assert argv[argv.index("--loss") + 1] == "cross_entropy"
    # as printed, bounded to one epoch into a temporary directory
    code, err = run_main([*argv[1:], "--epochs", "1", "--progress", "off",
                          "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["strategy"] == "single"


def test_pairs_without_a_loss_get_no_train_line_that_would_be_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, "--model", f"{MODELS}:cnn_factory", "--data",
                          f"{MODELS}:cnn_data", "--json")
    assert code == 0, err
    document = json.loads(out)["plan"]
    assert document["command"] is None and "cnn_factory()" in document["python"]


@pytest.mark.parametrize(("optimizer", "flag"), [
    ("sgd", "sgd"), ("rmsprop", "torch.optim:RMSprop"), (None, None),
])
def test_the_optimizer_planned_is_the_one_the_run_line_trains_with(
        optimizer: str | None, flag: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    from torchgpu.cli.train_flags import config_from_argv
    from torchgpu.train.config_checks import validate

    asked = ["--optimizer", optimizer] if optimizer else []
    code, out, err = plan(capsys, "--example", "housing", *asked)
    assert code == 0, err
    argv = run_line(out)
    assert (argv[argv.index("--optimizer") + 1] if "--optimizer" in argv else None) == flag
    validate(config_from_argv(argv[2:]))


def test_an_optimizer_no_flag_names_gets_no_train_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, "--example", "housing", "--optimizer", "sgd_momentum",
                          "--json")
    assert code == 0, err
    assert json.loads(out)["plan"]["command"] is None


@pytest.mark.parametrize(("argv", "needle"), [
    (["--example", "housing", "--loss", "mse"], "--loss mse goes with --model and --data"),
    (["--model", f"{MODELS}:cnn_factory", "--data", f"{MODELS}:cnn_data", "--loss", "hinge"],
     "not a built-in loss"),
    (["--model", f"{MODELS}:lm_factory", "--data", f"{MODELS}:lm_data", "--loss", "mse"],
     "yields dict batches"),
    (["--model", f"{MODELS}:cnn_factory", "--data", f"{MODELS}:cnn_data", "--loss",
      f"{MODELS}:nope"], "has no attribute 'nope'"),
])
def test_a_loss_train_would_refuse_is_refused_by_plan(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = plan(capsys, *argv)
    assert code == 2 and out == "", err
    assert needle in err and len(err.strip().splitlines()) == 1
