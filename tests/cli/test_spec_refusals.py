"""A user's model, data, loss or metrics that cannot train are refused before anything is
written, in one paragraph naming them (exit 2 on the command line, the error class from
``fit``), where they used to end in a traceback: a ``__len__`` no sampler can index in
memory, a model with no trainable parameters, a loss cut off from the gradients, metrics
that are not a ``{name: metric}`` dict."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from tests.procs import run_main
from torchgpu import fit
from torchgpu.errors import DataError, UsageError

run = run_main  # torchgpu ARGV in this process: (exit code, stderr)

SPECS = """
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

class Huge(Dataset):
    def __len__(self):
        return 2 ** 40

    def __getitem__(self, i):
        return torch.zeros(4), torch.zeros(1)

def huge():
    return Huge()

def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(20, 4, generator=g), torch.randn(20, 1, generator=g))

def model():
    return nn.Linear(4, 1)

def frozen():
    return nn.Linear(4, 1).requires_grad_(False)

def parameterless():
    return nn.ReLU()

def detached(output, target):
    return ((output - target) ** 2).mean().detach()

def through_item(output, target):
    return torch.tensor(((output - target) ** 2).mean().item())

class OwnLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, y):
        with torch.no_grad():
            return {"loss": ((self.fc(x) - y) ** 2).mean()}

class Dicts(Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, i):
        return {"x": torch.full((4,), float(i)), "y": torch.ones(1)}
"""


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    path = tmp_path / "specs.py"
    path.write_text(SPECS)
    return path


def refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    """``torchgpu train FLAGS``: exit 2, one paragraph, nothing written; the message."""
    out = tmp_path / "out"
    code, err = run(["train", *flags, "--epochs", "1", "--batch-size", "4", "--device", "cpu",
                     "--progress", "off", "--out", str(out)], capsys)
    assert code == 2, err
    assert len([line for line in err.strip().splitlines() if line.strip()]) == 1, err
    assert not out.exists()
    return err


def test_a_length_no_sampler_can_index_in_memory_is_refused(
        specs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(tmp_path, capsys, "--model", f"{specs}:model", "--data", f"{specs}:huge",
                  "--loss", "mse")
    assert "the training data has 1,099,511,627,776 samples" in err
    assert "48.0 TiB" in err and "IterableDataset" in err and "smaller" in err


def test_fit_refuses_a_length_no_sampler_can_index(specs: Path, tmp_path: Path) -> None:
    from torchgpu.factories import resolve_spec

    huge = resolve_spec(f"{specs}:Huge")()  # type: ignore[operator]
    with pytest.raises(DataError, match="1,099,511,627,776 samples"):
        fit(nn.Linear(4, 1), huge, loss=nn.MSELoss(), epochs=1, out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_the_length_bound_is_this_machines_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchgpu.data import loader

    monkeypatch.setattr(loader, "host_memory_bytes", lambda: 2**30)
    loader.check_order_fits(2**30 // loader.ORDER_BYTES_PER_SAMPLE, "data")
    with pytest.raises(DataError, match=r"more than this machine's 1\.0 GiB"):
        loader.check_order_fits(2**30 // loader.ORDER_BYTES_PER_SAMPLE + 1, "data")
    monkeypatch.setattr(loader, "host_memory_bytes", lambda: None)
    loader.check_order_fits(2**40, "data")  # unknown memory: the allocator decides


@pytest.mark.parametrize(("model", "words"), [
    ("frozen", "its 2 parameters are all frozen"),
    ("parameterless", "it is a ReLU without parameters"),
])
def test_a_model_with_nothing_to_train_is_refused(
        model: str, words: str, specs: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(tmp_path, capsys, "--model", f"{specs}:{model}", "--data", f"{specs}:data",
                  "--loss", "mse")
    assert f"--model {specs}:{model} has no trainable parameters ({words}" in err
    assert "empty parameter list" not in err


def test_fit_refuses_a_frozen_model(tmp_path: Path) -> None:
    data = TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
    with pytest.raises(UsageError, match="no trainable parameters"):
        fit(nn.Linear(4, 1).requires_grad_(False), data, loss=nn.MSELoss(), epochs=1,
            out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("loss", ["detached", "through_item"])
def test_a_loss_without_gradients_is_refused_naming_it(
        loss: str, specs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(tmp_path, capsys, "--model", f"{specs}:model", "--data", f"{specs}:data",
                  "--loss", f"{specs}:{loss}")
    assert f"--loss {specs}:{loss} of --model {specs}:model" in err
    assert "does not require gradients" in err and ".detach()" in err


def test_a_models_own_loss_without_gradients_is_refused_at_the_first_step(
        specs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The probe runs the model without gradients (a model's hooks may tell it from a
    step by that), so a loss the model computes under no_grad shows at the first
    backward: one paragraph there too, not torch's "does not require grad" traceback."""
    out = tmp_path / "out"
    code, err = run(["train", "--model", f"{specs}:OwnLoss", "--data", f"{specs}:Dicts",
                     "--epochs", "1", "--batch-size", "4", "--device", "cpu", "--progress",
                     "off", "--out", str(out)], capsys)
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith("torchgpu: the loss does not require "
                                                    "gradients"), err


def test_fit_refuses_a_detached_loss(tmp_path: Path) -> None:
    data = TensorDataset(torch.randn(20, 4), torch.randn(20, 1))
    mse = nn.MSELoss()
    with pytest.raises(UsageError, match=r"^the loss of .* does not require gradients"):
        fit(nn.Linear(4, 1), data, loss=lambda out, y: mse(out, y).detach(), epochs=1,
            out=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("metrics", "shown"), [
    ([1, 2], "metrics=[1, 2] is a list"),
    ("accuracy", "metrics='accuracy' is a str"),
])
def test_fit_refuses_metrics_that_are_not_a_dict(metrics: object, shown: str,
                                                 tmp_path: Path) -> None:
    data: Dataset[tuple[torch.Tensor, torch.Tensor]] = TensorDataset(
        torch.randn(20, 4), torch.randn(20, 1))
    with pytest.raises(UsageError) as caught:
        fit(nn.Linear(4, 1), data, loss=nn.MSELoss(), metrics=metrics,  # type: ignore[arg-type]
            epochs=1, out=str(tmp_path / "out"))
    assert shown in str(caught.value) and "{name: metric}" in str(caught.value)
    assert not (tmp_path / "out").exists()
