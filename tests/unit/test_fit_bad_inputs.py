"""Inputs users get wrong, refused before anything is written with the fix named:
tokenizer-style items (Python lists of token ids), a (train, eval) pair passed as the
training data, a factory returning a Python list of blocks, and a model that cannot be
cut into stages (the accepted form, nn.ModuleList, named)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from tests.procs import run_main
from tests.user_models import BNConvNet, ImageDataset, TinyCausalLM, TokenDataset
from torchgpu import fit
from torchgpu.errors import DataError, UsageError


class ListTokens(Dataset[dict[str, Any]]):
    """What a tokenizer returns without return_tensors: Python lists of ints."""

    def __init__(self, n: int = 16) -> None:
        self.ids = TokenDataset(n).ids

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = self.ids[i].tolist()
        return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids}


def list_tokens() -> ListTokens:  # a --data spec
    return ListTokens()


def test_tokenizer_lists_are_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError) as info:
        fit(TinyCausalLM, ListTokens(), epochs=1, batch_size=4, out=tmp_path / "run",
            progress="off")
    message = str(info.value)
    assert "'input_ids' is a Python list of 12 ints" in message
    assert "return_tensors='pt'" in message and "torch.tensor" in message
    assert not (tmp_path / "run").exists()


def test_tokenizer_lists_exit_2_on_the_cli(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(["train", "--model", "tests.user_models:lm_factory",
                          "--data", "tests.unit.test_fit_bad_inputs:list_tokens",
                          "--epochs", "1", "--batch-size", "4", "--out", str(tmp_path / "run")],
                         capsys)  # in this process; no traceback allowed
    assert code == 2, err[-2000:]
    assert "Python list of 12 ints" in err
    assert not (tmp_path / "run").exists()


def test_a_train_eval_pair_as_train_data_says_how_to_pass_it(tmp_path: Path) -> None:
    for pair in [(ImageDataset(8), ImageDataset(4)), [ImageDataset(8), None]]:
        with pytest.raises(UsageError, match=r"\(train, eval\) pair of datasets.*eval_data="):
            fit(BNConvNet, pair, loss=nn.CrossEntropyLoss(), out=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    # a list of samples is still data, not a pair of datasets
    samples = [ImageDataset(8)[i] for i in range(8)]
    result = fit(BNConvNet, samples, loss=nn.CrossEntropyLoss(), epochs=1, batch_size=4,
                 progress="off", out=tmp_path / "samples")
    assert result.summary["final"]["train_loss"] > 0


def blocks_list() -> list[nn.Module]:  # a --model spec returning a Python list
    return [nn.Linear(4, 4), nn.Linear(4, 1)]


def test_a_list_of_blocks_is_told_to_be_a_module_list() -> None:
    with pytest.raises(UsageError, match=r"nn\.ModuleList or nn\.Sequential, not a Python list"):
        fit(blocks_list, [(torch.zeros(4), torch.zeros(1))] * 4, loss=nn.MSELoss(),
            progress="off")


def test_split_strategies_name_the_module_list(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_main(["train", "--model", "tests.user_models:cnn_factory",
                          "--data", "tests.user_models:cnn_data", "--loss", "cross_entropy",
                          "--strategy", "model", "--devices", "cpu,cpu", "--epochs", "1",
                          "--out", str(tmp_path / "run")], capsys)  # in this process
    assert code == 2, err[-2000:]
    assert "is not an nn.ModuleList of blocks" in err
    code, err = run_main(["train", "--model", "tests.unit.test_fit_bad_inputs:blocks_list",
                          "--data", "tests.user_models:cnn_data", "--loss", "cross_entropy",
                          "--epochs", "1", "--out", str(tmp_path / "run")], capsys)
    assert code == 2 and "nn.ModuleList or nn.Sequential" in err


class _NoLength(Dataset[Any]):
    def __len__(self) -> int:
        raise TypeError("length unknown")

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(4), torch.zeros(1)


def test_a_dataset_whose_len_fails_is_named(tmp_path: Path) -> None:
    """A user's __len__ that raises is a DataError naming it, not its own traceback."""
    with pytest.raises(DataError, match=r"len\(\) failed \(TypeError: length unknown\)"):
        fit(nn.Linear(4, 1), _NoLength(), loss=nn.MSELoss(), epochs=1, out=str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("setting", "value", "needle"), [
    ("epochs", "3", "epochs='3' is of type str, but epochs takes an integer or None"),
    ("epochs", True, "epochs=True is of type bool"),
    ("batch_size", "big", "takes an integer or 'auto' or None"),
    ("lr", "0.1", "lr='0.1' is of type str, but lr takes a number or None"),
    ("activation_checkpointing", 1, "takes True or False or a string"),
    ("out", 123, "out=123 is of type int"),
])
def test_a_setting_of_the_wrong_type_is_named(setting: str, value: object, needle: str,
                                              tmp_path: Path) -> None:
    """fit's settings take what their flags take: a wrong type is a UsageError naming the
    setting, not a TypeError from deep in the run or a silent truth test."""
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    settings: dict[str, Any] = {"epochs": 1, "progress": "off", "out": str(tmp_path / "o"),
                                setting: value}
    with pytest.raises(UsageError) as caught:
        fit(nn.Linear(4, 1), data, loss=nn.MSELoss(), **settings)
    assert needle in str(caught.value)
    assert not (tmp_path / "o").exists()


def test_numpy_numbers_paths_and_device_lists_are_taken(tmp_path: Path) -> None:
    import numpy as np
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    result = fit(nn.Linear(4, 1), data, loss=nn.MSELoss(), epochs=np.int64(1),
                 batch_size=np.int32(4), lr=np.float32(0.01), progress="off",
                 out=tmp_path / "o")
    assert result.summary["batch_size"] == 4 and (tmp_path / "o" / "summary.json").is_file()
    from torchgpu.train.fit import config_from_settings

    config = config_from_settings({"devices": ["cpu", "cpu"], "strategy": "pipeline"}, "m")
    assert config.devices == "cpu,cpu"
