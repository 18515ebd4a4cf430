"""A fit run without ``out`` is written to ``runs/<name>-<time>``, named after the model:
its class, or its factory function's name; a lambda (a recipe's ``fit(lambda:
BertForSequenceClassification(config), ...)``) has none, and the run is ``model``, not a
directory called ``<lambda>-...``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from torchgpu import fit


def build_net() -> nn.Module:
    return nn.Linear(3, 1)


@pytest.mark.parametrize(("model", "name"), [
    (lambda: nn.Linear(3, 1), "model"),
    (build_net, "build_net"),
    (nn.Linear(3, 1), "Linear"),
], ids=["lambda", "function", "module"])
def test_the_default_out_is_named_after_the_model(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, model: object, name: str) -> None:
    monkeypatch.chdir(tmp_path)
    data = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    result = fit(model, data, loss=nn.MSELoss(), epochs=1, batch_size=4, progress="off",
                 device="cpu")
    assert result.out_dir is not None
    assert result.out_dir.parent.resolve() == (tmp_path / "runs").resolve()
    assert result.out_dir.name.rsplit("-", 2)[0] == name
    assert f'model = "fit:{name}"' in (result.out_dir / "config.toml").read_text()
