"""The files a run is built from (a spec's file, a CSV) are fingerprinted (sha256) in
config.toml, summary.json and each checkpoint: a replay (`--config`) whose files changed
warns naming each, a resume refuses (exit 2, nothing changed) unless --force-resume, and
each file is hashed once per run."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.procs import run_main
from torchgpu.train import fingerprints
from torchgpu.train.fit import config_from_settings

tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the reader falls back to tomli)

SPEC = '''"""A model and data for --model/--data file specs."""
import torch
from torch import nn
from torch.utils.data import TensorDataset


def build():
    return nn.Linear(3, 1)


def data():
    x = torch.randn(32, 3, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)
    return TensorDataset(x, y), TensorDataset(x[:8], y[:8])
'''


def _csv(path: Path, bump: int = 0) -> None:
    rows = ["a,b,y"] + [f"{i % 7},{(i * 3) % 5},{i % 7 + 2 * ((i * 3) % 5) + bump}"
                        for i in range(60)]
    path.write_text("\n".join(rows) + "\n")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hashes(out: Path) -> dict[str, str]:
    return {str(p.relative_to(out)): _sha(p) for p in sorted(out.rglob("*")) if p.is_file()}


CSV_RUN = ["train", "--target", "y", "--epochs", "1", "--batch-size", "8", "--device", "cpu",
           "--progress", "off"]


def test_a_replay_whose_csv_changed_warns_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "t.csv"
    _csv(table)
    first = tmp_path / "a"
    assert run_main([*CSV_RUN, "--data", str(table), "--out", str(first)], capsys)[0] == 0
    recorded = {str(table): _sha(table)}
    config = tomllib.loads((first / "config.toml").read_text())
    assert config["fingerprints"] == recorded
    assert json.loads((first / "summary.json").read_text())["fingerprints"] == recorded
    replay = ["train", "--config", str(first / "config.toml"), "--progress", "off"]
    code, err = run_main([*replay, "--out", str(tmp_path / "b")], capsys)
    assert code == 0 and "warning" not in err, err  # unchanged: nothing to say
    old = _sha(table)
    _csv(table, bump=1)  # the same rows and columns, other targets
    code, err = run_main([*replay, "--out", str(tmp_path / "c")], capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert str(table) in warnings[0] and str(first / "config.toml") in warnings[0]
    assert old[:12] in warnings[0] and _sha(table)[:12] in warnings[0]


def test_each_file_is_hashed_once_per_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay check, config.toml, summary.json and the checkpoints share one hash."""
    table = tmp_path / "t.csv"
    _csv(table)
    first = tmp_path / "a"
    assert run_main([*CSV_RUN, "--data", str(table), "--out", str(first)], capsys)[0] == 0
    calls: list[Any] = []
    real = hashlib.sha256

    def counted(*args: Any) -> Any:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(fingerprints, "_hashed", {})
    monkeypatch.setattr(fingerprints, "hashlib", SimpleNamespace(sha256=counted))
    assert run_main(["train", "--config", str(first / "config.toml"), "--save-every", "2",
                     "--progress", "off", "--out", str(tmp_path / "b")], capsys)[0] == 0
    assert len(calls) == 1


@pytest.fixture
def spec_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, list[str]]:
    """A finished 1-epoch run of a --model/--data file spec, checkpointed; the command."""
    spec = tmp_path / "net.py"
    spec.write_text(SPEC)
    out = tmp_path / "run"
    argv = ["train", "--model", f"{spec}:build", "--data", f"{spec}:data", "--loss", "mse",
            "--batch-size", "8", "--device", "cpu", "--progress", "off", "--out", str(out)]
    assert run_main([*argv, "--epochs", "1", "--save-every", "2"], capsys)[0] == 0
    assert tomllib.loads((out / "config.toml").read_text())["fingerprints"] == {
        str(spec): _sha(spec)}
    return out, argv


def test_a_resume_whose_spec_file_changed_is_refused_unless_forced(
        spec_run: tuple[Path, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    out, argv = spec_run
    spec = out.parent / "net.py"
    old = _sha(spec)
    spec.write_text(SPEC + "# edited since\n")
    before = _hashes(out)
    code, err = run_main([*argv, "--epochs", "2", "--resume"], capsys)
    assert code == 2, err
    message = err.strip().splitlines()[-1]
    assert message.startswith("torchgpu: cannot resume") and str(spec) in message, err
    assert old[:12] in message and _sha(spec)[:12] in message and "--force-resume" in message
    assert _hashes(out) == before
    code, err = run_main([*argv, "--epochs", "2", "--resume", "--force-resume",
                          "--save-every", "2"], capsys)
    assert code == 0, err
    assert "--force-resume" in err and str(spec) in err  # a note says what was forced
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["fingerprints"] == {str(spec): _sha(spec)}
    # the new checkpoints record the file as it is now: a plain resume goes on
    assert run_main([*argv, "--epochs", "3", "--resume"], capsys)[0] == 0


def test_built_in_examples_record_no_files_and_fit_takes_force_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ex"
    assert run_main(["train", "--example", "housing", "--data-size", "40", "--epochs", "1",
                     "--device", "cpu", "--progress", "off", "--out", str(out)], capsys)[0] == 0
    assert "fingerprints" not in tomllib.loads((out / "config.toml").read_text())
    assert json.loads((out / "summary.json").read_text())["fingerprints"] == {}
    assert config_from_settings({"force_resume": True}, "Net").force_resume
    assert "force_resume" not in (out / "config.toml").read_text()  # never replayed
