"""`torchgpu train --resume` refuses, in one paragraph (exit 2) and without changing a
byte under --out, a resume that asks for fewer steps than were done and a checkpoint
whose files match their manifest but whose state.pt content is malformed."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.procs import run_main
from torchgpu import fit
from torchgpu.checkpoint.layout import MANIFEST_FILE, REQUIRED_FILES
from torchgpu.checkpoint.manifest import manifest_bytes
from torchgpu.errors import UsageError

# housing, 40 rows: 32 train rows in batches of 8 = 4 optimizer steps per epoch
RUN = ["train", "--example", "housing", "--data-size", "40", "--batch-size", "8",
       "--device", "cpu", "--progress", "off"]


def _hashes(out: Path) -> dict[str, str]:
    """Every file under ``out``, by relative path, with the sha256 of its bytes."""
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file()}


def _error(err: str) -> str:
    """The error paragraph: the last line of stderr (notes on the device come first)."""
    message = err.strip().splitlines()[-1]
    assert message.startswith("torchgpu: "), err
    return message


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-epoch run (8 steps) with a checkpoint every 4 steps."""
    out = tmp_path_factory.mktemp("runs") / "done"
    from torchgpu.cli.main import main

    assert main([*RUN, "--epochs", "2", "--save-every", "4", "--out", str(out)]) == 0
    return out


def _copy(run: Path, where: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, where / "run"))


def test_a_resume_asking_for_fewer_steps_than_done_changes_nothing(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(finished, tmp_path)
    before = _hashes(out)
    code, err = run_main([*RUN, "--epochs", "1", "--resume", "--out", str(out)], capsys)
    assert code == 2, err
    message = _error(err)
    assert "8 optimizer steps" in message and "asks for 4 steps" in message, err
    assert "--epochs 2 or more" in message, err
    assert _hashes(out) == before
    # the same number of epochs is not shorter: the run resumes (and has nothing left)
    assert run_main([*RUN, "--epochs", "2", "--resume", "--out", str(out)], capsys)[0] == 0


def test_fit_refuses_the_shorter_resume_as_a_usage_error(tmp_path: Path) -> None:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    out = tmp_path / "fit"
    settings: dict[str, Any] = {"batch_size": 4, "out": out, "progress": "off",
                                "save_every": 4, "device": "cpu"}
    fit(nn.Linear(3, 1), data, loss=nn.functional.mse_loss, epochs=2, **settings)
    before = _hashes(out)
    with pytest.raises(UsageError, match=r"8 optimizer steps.*asks for 4 steps"):
        fit(nn.Linear(3, 1), data, loss=nn.functional.mse_loss, epochs=1, resume=True,
            **settings)
    assert _hashes(out) == before


def _rewrite(ckpt: Path, change: Callable[[dict[str, Any]], None]) -> None:
    """``change`` state.pt, then write the manifest again so its hashes match."""
    state = torch.load(ckpt / "state.pt", weights_only=True)
    change(state)
    torch.save(state, ckpt / "state.pt")
    (ckpt / MANIFEST_FILE).write_bytes(manifest_bytes({n: (ckpt / n).read_bytes()
                                                       for n in REQUIRED_FILES}))


def _other_shape(state: dict[str, Any]) -> None:
    moments = state["optimizer"]["state"][0]
    moments["exp_avg"] = torch.zeros(moments["exp_avg"].numel() + 3)


def _huge_step(state: dict[str, Any]) -> None:
    state["extra"]["train_state"]["step"] = 10**12


def _losses_text(state: dict[str, Any]) -> None:
    state["extra"]["train_state"]["step_losses"] = "0.5, 0.4"


def _consistent_huge_step(state: dict[str, Any]) -> None:
    train_state = state["extra"]["train_state"]
    train_state["step"] = 40
    train_state["step_losses"] = [0.5] * 40


@pytest.mark.parametrize(("change", "words"), [
    (_other_shape, ["'exp_avg' of parameter 0 has shape [211]", "expected [16, 13]"]),
    (_huge_step, ["train_state.step is 1000000000000", "4 losses"]),
    (_losses_text, ["train_state.step_losses is str '0.5, 0.4'", "a list of numbers"]),
    (_consistent_huge_step, ["train_state.step is 40", "expected at most 4"]),
])
def test_a_malformed_checkpoint_that_matches_its_manifest_is_refused(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        change: Callable[[dict[str, Any]], None], words: list[str]) -> None:
    out = _copy(finished, tmp_path)
    ckpt = out / "checkpoints" / "step-00000004"
    _rewrite(ckpt, change)
    before = _hashes(out)
    code, err = run_main([*RUN, "--epochs", "2", "--resume", str(ckpt), "--out", str(out)],
                         capsys)
    assert code == 2, err
    message = _error(err)
    assert str(ckpt) in message, err
    for word in words:
        assert word in message, err
    assert _hashes(out) == before


def test_an_optimizer_step_count_beyond_the_runs_steps_is_refused(
        finished: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = _copy(finished, tmp_path)
    ckpt = out / "checkpoints" / "step-00000004"

    def huge(state: dict[str, Any]) -> None:
        state["optimizer"]["state"][0]["step"] = torch.tensor(float(10**12))

    _rewrite(ckpt, huge)
    before = _hashes(out)
    code, err = run_main([*RUN, "--epochs", "2", "--resume", str(ckpt), "--out", str(out)],
                         capsys)
    message = _error(err)
    assert code == 2 and str(ckpt) in message, err
    assert "optimizer state 'step' of parameter 0" in message, err
    assert "expected a whole number from 0 to 4" in message, err
    assert _hashes(out) == before
