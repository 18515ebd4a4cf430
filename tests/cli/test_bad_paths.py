"""Paths the user names that the operating system refuses -- a 300-character name, a
file that fails to read (/proc/self/mem: EIO), a permission denied, a directory or a
device -- and integer values beyond what torch or the OS take: every verb answers exit 2
with one paragraph naming the flag and the path or value, never a traceback."""

from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path

import pytest

from tests.procs import run_main
from torchgpu.errors import DataError, UsageError

LONG = "a" * 300


run = run_main  # torchgpu ARGV in this process: (exit code, stderr)


def one_paragraph(err: str) -> bool:
    return len([line for line in err.strip().splitlines() if line.strip()]) == 1


def too_long(tmp_path: Path, suffix: str) -> str:
    return str(tmp_path / f"{LONG}{suffix}")


@pytest.mark.parametrize("case", [
    "train-data", "train-config", "train-model", "train-data-spec", "train-loss",
    "plan-model", "doctor-model", "launch-script", "bench-out", "bench-all-out",
])
def test_a_name_longer_than_the_file_system_allows(
        case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "out")
    data = tmp_path / "data.py"
    data.write_text("import torch\nfrom torch.utils.data import TensorDataset\n\n\n"
                    "def g():\n    return TensorDataset(torch.randn(20, 3), "
                    "torch.randn(20, 3))\n")
    argv = {
        "train-data": ["train", "--data", too_long(tmp_path, ".csv"), "--target", "y",
                       "--out", out],
        "train-config": ["train", "--config", too_long(tmp_path, ".toml"), "--out", out],
        "train-model": ["train", "--model", too_long(tmp_path, ".py") + ":f", "--data",
                        too_long(tmp_path, ".py") + ":g", "--out", out],
        "train-data-spec": ["train", "--model", "torch.nn:Identity", "--data",
                            too_long(tmp_path, ".py") + ":g", "--out", out],
        "train-loss": ["train", "--model", "torch.nn:Identity", "--data", f"{data}:g",
                       "--loss", too_long(tmp_path, ".py") + ":l", "--out", out],
        "plan-model": ["plan", "--model", too_long(tmp_path, ".py") + ":f", "--input-shape",
                       "2,3"],
        "doctor-model": ["doctor", "--model", too_long(tmp_path, ".py") + ":f",
                         "--input-shape", "2,3"],
        "launch-script": ["launch", "--nproc", "1", too_long(tmp_path, ".py")],
        "bench-out": ["bench", "matmul", "--quick", "--out", too_long(tmp_path, "")],
        "bench-all-out": ["bench", "all", "--quick", "--out", too_long(tmp_path, "")],
    }[case]
    code, err = run(argv, capsys)
    assert code == 2, err
    assert one_paragraph(err), err
    assert "characters long and this file system allows at most" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("flag", ["--data", "--config", "launch"])
def test_a_file_that_fails_to_read_is_named(
        flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """/proc/self/mem is a regular file whose read fails (EIO); launch used to start
    workers that ran it as an empty script."""
    extra = ["--target", "y"] if flag == "--data" else []
    argv = (["launch", "--nproc", "1", "/proc/self/mem"] if flag == "launch" else
            ["train", flag, "/proc/self/mem", *extra, "--out", str(tmp_path / "out")])
    code, err = run(argv, capsys)
    assert code == 2 and one_paragraph(err), err
    assert "/proc/self/mem could not be read (Input/output error)" in err


@pytest.mark.parametrize(("path", "kind"), [("/dev/zero", "a character device"),
                                            (".", "a directory")])
@pytest.mark.parametrize("flag", ["--data", "--config"])
def test_a_directory_or_a_device_is_refused_unread(
        flag: str, path: str, kind: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    if not Path(path).exists():
        pytest.skip(f"{path} does not exist here")
    extra = ["--target", "y"] if flag == "--data" else []
    code, err = run(["train", flag, path, *extra, "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and one_paragraph(err), err
    assert f"{path} is {kind}, not a file" in err


def _denied(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Reading a file called ``name`` fails as for a non-root user on a chmod-000 file."""
    real_open = Path.open

    def refuse(self: Path, *args: object, **kwargs: object) -> object:
        if self.name == name:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr(Path, "open", refuse)


def test_a_csv_that_cannot_be_read_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "table.csv"
    table.write_text("a,y\n1,2\n3,4\n5,6\n7,8\n9,10\n11,12\n13,14\n15,16\n17,18\n19,20\n")
    table.chmod(0)
    if os.geteuid() == 0:  # root reads anything: make the read fail as it would
        _denied(monkeypatch, "table.csv")
    code, err = run(["train", "--data", str(table), "--target", "y", "--out",
                     str(tmp_path / "out")], capsys)
    assert code == 2 and one_paragraph(err), err
    assert f"data file {table} cannot be read: permission denied" in err


def test_a_config_that_cannot_be_read_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.toml"
    config.write_text("epochs = 1\n")
    config.chmod(0)
    if os.geteuid() == 0:
        _denied(monkeypatch, "run.toml")
    code, err = run(["train", "--config", str(config), "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and one_paragraph(err), err
    assert f"--config {config} cannot be read: permission denied" in err


def test_the_helper_maps_every_os_error(tmp_path: Path) -> None:
    from torchgpu import user_files

    for code, needle in [(errno.EIO, "could not be read (Input/output error)"),
                         (errno.EACCES, "permission denied"), (errno.ELOOP, "link loop"),
                         (errno.ENOENT, "does not exist")]:
        with pytest.raises(DataError, match=r"--data x\.csv .*" + needle.replace("(", r"\(")
                           .replace(")", r"\)")), \
                user_files.reading("x.csv", what="--data", fix="Fix.", error=DataError):
            raise OSError(code, os.strerror(code))
    with pytest.raises(UsageError, match="is not a path"):
        user_files.check_file("a\0b", what="--config", fix="Fix.")


@pytest.mark.parametrize(("argv", "needle"), [
    (["bench", "matmul", "--quick", "--threads", "99999999999"], "out of range"),
    (["bench", "matmul", "--quick", "--threads", str(2**31)], "out of range"),
    (["bench", "matmul", "--quick", "--threads", "0"], "out of range"),
    (["doctor", "--model", "torch.nn:Identity", "--devices", "cuda:0", "--input-shape",
      "99999999999,99999999999"], "elements"),
    (["doctor", "--model", "torch.nn:Identity", "--input-shape", "9" * 30], "out of range"),
    (["doctor", "--model", "torch.nn:Identity", "--devices", "cuda:99999999999999999999",
      "--input-shape", "2,3"], "0..127"),
    (["doctor", "--model", "torch.nn:Identity", "--devices", "cuda:128", "--input-shape",
      "2,3"], "0..127"),
    (["doctor", "--model", "torch.nn:Identity", "--devices", "cuda:-1", "--input-shape",
      "2,3"], "not a device"),
    (["launch", "--max-restarts", str(2**63), "x.py"], "out of range"),
])
def test_integers_beyond_what_torch_takes(argv: list[str], needle: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(argv, capsys)
    assert code == 2 and one_paragraph(err), err
    assert needle in err


def test_an_empty_gpus_value_is_shown(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["train", "--gpus", "", "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and one_paragraph(err), err
    assert "--gpus ''" in err


def test_launch_of_a_missing_module_is_refused_before_any_worker(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run(["launch", "--nproc", "2", "-m", "torchgpu_no_such_module_zz"], capsys)
    assert code == 2 and one_paragraph(err), err
    assert "no module 'torchgpu_no_such_module_zz'" in err
    code, err = run(["launch", "-m", "torchgpu.no_such_submodule"], capsys)
    assert code == 2 and "no module 'torchgpu.no_such_submodule' in torchgpu" in err


def test_launch_of_a_module_in_this_directory_is_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchgpu.cli.launch import check_module

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "mine" / "job.py").write_text("")
    monkeypatch.chdir(tmp_path)
    check_module("mine.job")
    check_module("json.tool")
    with pytest.raises(UsageError, match=r"no module 'mine\.other'"):
        check_module("mine.other")
    assert "mine" not in sys.modules  # found, not imported


@pytest.mark.parametrize(("text", "header"), [
    ("a b c y\n1 2 3 4\n5 6 7 8\n", "space-separated"),
    ("a  b   y\n1  2   3\n4  5   6\n", "space-separated"),
    ("a;b;y\n1;2;3\n4;5;6\n", "semicolon-separated"),
])
def test_a_csv_with_another_separator_is_named(
        text: str, header: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "t.csv"
    table.write_text(text)
    code, err = run(["train", "--data", str(table), "--target", "y", "--out",
                     str(tmp_path / "out")], capsys)
    assert code == 2 and one_paragraph(err), err
    assert header in err and "encode categories" not in err


@pytest.mark.parametrize(("flags", "needle"), [
    (["--nproc", "2", "--strategy", "ddp", "--batch-size", "300"],
     "one optimizer step of 600 (2 processes x --batch-size 300): use --batch-size 202"),
    (["--nproc", "2", "--strategy", "ddp", "--batch-size", "203"], "step of 406"),
    (["--batch-size", "200", "--accumulate", "4"],
     "step of 800 (--batch-size 200 x --accumulate 4): use --batch-size 101"),
])
def test_an_optimizer_step_larger_than_the_train_split_is_refused(
        flags: list[str], needle: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """housing's train split holds 405 samples: a step of more (over processes and
    accumulation) was accepted, trained a short step, and the summary claimed it."""
    out = tmp_path / "out"
    code, err = run(["train", "--example", "housing", "--epochs", "1", "--device", "cpu",
                     *flags, "--out", str(out)], capsys)
    assert code == 2 and one_paragraph(err), err
    assert "the train split holds 405 samples" in err and needle in err
    assert not out.exists()


@pytest.mark.parametrize("source", ["example", "csv", "spec"])
def test_batch_size_auto_trains_a_split_smaller_than_the_default_batch(
        source: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Ten training rows, fewer than the default batch (16, 32 for a CSV): ``--batch-size
    auto`` asks for a batch that fits the data, as ``fit(batch_size="auto")`` does, so the
    checks against one default batch must not refuse it."""
    table = tmp_path / "t.csv"
    table.write_text("a,b,y\n" + "".join(f"{i},{i % 5},{i % 3}\n" for i in range(12)))
    flags = {"example": ["--example", "housing", "--data-size", "12"],
             "csv": ["--data", str(table), "--target", "y"],
             "spec": ["--model", "tests.user_models:seq_factory", "--data",
                      "tests.user_models:ten_rows", "--loss", "mse", "--accumulate", "2"]}
    out = tmp_path / "out"
    code, err = run(["train", *flags[source], "--batch-size", "auto", "--epochs", "1",
                     "--device", "cpu", "--progress", "off", "--out", str(out)], capsys)
    assert code == 0, err
    # auto keeps the effective batch a fixed batch would take (16, or 32 for a CSV):
    # the ten rows make one partial step, not a refusal
    assert re.search(r"training with micro-batch \d+ x \d+ accumulation", err), err
    assert (out / "summary.json").is_file()


@pytest.mark.parametrize("rdzv_id", ["/proc/x", "a" * 300, "", "job 1", "a/b"])
def test_launch_refuses_a_rendezvous_id_torchrun_cannot_name_a_directory_after(
        rdzv_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "job.py"
    script.write_text("")
    code, err = run(["launch", "--rdzv-id", rdzv_id, str(script)], capsys)
    assert code == 2 and one_paragraph(err), err
    assert "--rdzv-id" in err and "letters, digits" in err


def test_launch_accepts_a_scheduler_job_id(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchgpu.launch import run as launcher

    for rdzv_id in ("12345", "job-42", "run_7.a"):
        launcher.check_rdzv_id(rdzv_id)
