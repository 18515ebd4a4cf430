"""An ``--out`` holding a run's files (a crashed run's checkpoints, its config.toml) is
never written over by a run that neither continues it (``--resume``) nor replaces it
(``--overwrite``): exit 2, every byte left, the newest checkpoint and the exact commands
named; ``--overwrite`` removes the old run's entries and nothing else; the same for
``fit``."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.procs import run_cli, run_main
from torchgpu import fit
from torchgpu.errors import UsageError

# housing, 80 samples: 4 optimizer steps per epoch; a checkpoint every 2 steps
RUN = ["train", "--data-size", "80", "--epochs", "3", "--save-every", "2",
       "--progress", "off"]


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run killed (SIGKILL) right after step 5: checkpoints of steps 2 and 4, its
    config.toml and epoch 1's metrics, no summary."""
    root = tmp_path_factory.mktemp("crashed")
    out = root / "run"
    done = run_cli([*RUN, "--out", str(out)], timeout=180,
                   TORCHGPU_FAULT_CRASH_AT_STEP="5",
                   TORCHGPU_FAULT_MARKER=str(root / "marker"))
    assert done.returncode != 0 and (root / "marker").exists(), done.stderr[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == [
        "step-00000002", "step-00000004"]
    assert not (out / "summary.json").exists()
    return out


def _copy(crashed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(crashed, out)
    return out


def test_rerun_after_a_crash_is_refused_and_its_resume_command_continues_it(
        crashed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(crashed, tmp_path)
    before = _files(out)
    code, err = run_main([*RUN, "--lr", "0.1", "--out", str(out)], capsys)
    assert code == 2, err
    text = " ".join(err.split())
    assert "already holds a run" in text and "nothing was written or changed" in text
    assert str(out / "checkpoints" / "step-00000004") in text
    assert "(lr 0.01, not 0.1)" in text and "--overwrite" in text
    assert _files(out) == before  # not one byte of the crashed run changed
    # The command the message gives continues the crashed run, with its own lr.
    command = re.search(r"run: (torchgpu train .*? --resume)\.", text)
    assert command is not None, text
    argv = shlex.split(command.group(1))
    assert argv[argv.index("--lr") + 1] == "0.01"
    code, err = run_main(argv[1:], capsys)
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12
    assert summary["checkpoints"]["resumed_from"] == str(out / "checkpoints" / "step-00000004")


def test_overwrite_replaces_the_run_and_keeps_other_files(
        crashed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(crashed, tmp_path)
    old = (out / "checkpoints" / "step-00000004" / "model.safetensors").read_bytes()
    (out / "notes.txt").write_text("mine")
    (out / "data").mkdir()
    (out / "data" / "rows.csv").write_text("x\n1\n")
    code, err = run_main([*RUN, "--lr", "0.1", "--overwrite", "--out", str(out)], capsys)
    assert code == 0, err
    assert "--overwrite: removed the previous run's" in err
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "data" / "rows.csv").read_text() == "x\n1\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["checkpoints"]["resumed_from"] is None
    new = (out / "checkpoints" / "step-00000004" / "model.safetensors").read_bytes()
    assert new != old  # trained again at lr 0.1
    steps = [json.loads(line)["step"] for line in
             (out / "metrics.jsonl").read_text().splitlines() if '"kind": "step"' in line]
    assert steps == list(range(1, 13))  # the crashed run's lines are gone, none twice
    assert 'lr = 0.1' in (out / "config.toml").read_text()


def test_overwrite_with_resume_is_refused(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main([*RUN, "--overwrite", "--resume", "--out", str(tmp_path / "r")],
                         capsys)
    assert code == 2 and "--overwrite and --resume" in err
    assert not (tmp_path / "r").exists()


def _fit(out: Path, **settings: object):  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(0)
    train = TensorDataset(torch.randn(32, 4, generator=generator),
                          torch.randn(32, 1, generator=generator))

    def net() -> nn.Module:
        return nn.Linear(4, 1)

    return fit(net, train, loss=nn.MSELoss(), epochs=2, batch_size=8, save_every=2,
               out=out, progress="off", **settings)


def test_fit_refuses_an_out_holding_checkpoints_until_resume_or_overwrite(
        tmp_path: Path) -> None:
    out = tmp_path / "run"
    _fit(out)
    for name in ("summary.json", "model.safetensors", "loss.png", "metrics.jsonl"):
        (out / name).unlink(missing_ok=True)  # what a crash leaves: checkpoints, config
    before = _files(out)
    with pytest.raises(UsageError) as refused:
        _fit(out, lr=0.1)
    text = str(refused.value)
    assert str(out / "checkpoints" / "step-00000008") in text
    assert "resume=True, lr=0.001" in text and "overwrite=True" in text
    assert _files(out) == before
    resumed = _fit(out, resume=True)
    assert resumed.summary["checkpoints"]["resumed_from"] == str(
        out / "checkpoints" / "step-00000008")
    replaced = _fit(out, lr=0.1, overwrite=True)
    assert replaced.summary["checkpoints"]["resumed_from"] is None
    assert replaced.summary["steps"] == 8
