"""Spec resolution (torchgpu.factories): module:attr and file.py:attr to models, data and
callables, with one-paragraph errors naming the spec, what was found and the fix."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from torch import nn
from torch.utils.data import TensorDataset

from tests.user_models import TinyCausalLM, TokenDataset
from torchgpu.errors import DataError, UsageError
from torchgpu.factories import (
    is_dataset,
    resolve_callable,
    resolve_data,
    resolve_factory,
    resolve_model,
    resolve_spec,
)

FILE_SRC = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, {width})

def build():
    return Net()

MODEL = nn.Linear(3, 3)
DATA = TensorDataset(torch.zeros(4, 2), torch.zeros(4))
PAIR = (DATA, DATA)
PAIR_NO_EVAL = [DATA, None]
SAMPLES = [(torch.zeros(2), 0), (torch.zeros(2), 1)]
BAD_EVAL = (DATA, 3)
NUMBER = 7

def data():
    return DATA, DATA

def broken():
    raise RuntimeError("no weights here")

def not_a_model():
    return 42

def needs_args(width):
    return nn.Linear(width, width)
"""


@pytest.fixture
def specfile(tmp_path: Path) -> str:
    path = tmp_path / "model.py"
    path.write_text(FILE_SRC.format(width=5))
    return str(path)


def test_module_and_file_forms(specfile: str) -> None:
    assert resolve_spec("torch.nn:Linear") is nn.Linear
    assert resolve_spec("collections:OrderedDict.fromkeys") is not None
    model = resolve_model(f"{specfile}:build")
    assert type(model).__name__ == "Net" and model.fc.out_features == 5
    # the same file resolves to the same module: its classes stay identical
    assert type(resolve_model(f"{specfile}:build")) is type(model)


def test_two_files_with_the_same_name_do_not_clash(tmp_path: Path, specfile: str) -> None:
    other = tmp_path / "sub" / "model.py"
    other.parent.mkdir()
    other.write_text(FILE_SRC.format(width=9))
    first, second = resolve_model(f"{specfile}:build"), resolve_model(f"{other}:build")
    assert (first.fc.out_features, second.fc.out_features) == (5, 9)


def test_resolve_model_takes_a_module_a_function_or_a_class(specfile: str) -> None:
    assert isinstance(resolve_model(f"{specfile}:MODEL"), nn.Linear)
    assert isinstance(resolve_model("tests.user_models:lm_factory"), TinyCausalLM)
    assert isinstance(resolve_model("tests.user_models:TinyCausalLM"), TinyCausalLM)


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("broken", "broken() failed: RuntimeError: no weights here"),
        ("not_a_model", "returned a int, not an nn.Module"),
        ("needs_args", "needs_args() failed: TypeError"),
        ("NUMBER", "names a int, neither an nn.Module nor a factory"),
        ("nothing", "has no attribute 'nothing'"),
    ],
)
def test_resolve_model_errors(specfile: str, attr: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        resolve_model(f"{specfile}:{attr}")
    text = str(info.value)
    assert message in text and f"{specfile}:{attr}" in text and "--model" in text
    assert info.value.exit_code == 2 and "\n" not in text


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "is not understood"),
        (":build", "is not understood"),
        ("mod:", "is not understood"),
        ("mod:a..b", "is not understood"),
        ("no_such_module_xyz:build", "no module named 'no_such_module_xyz'"),
        ("missing/file.py:build", "does not exist"),
    ],
)
def test_resolve_spec_errors_name_the_spec_and_the_forms(spec: str, message: str) -> None:
    with pytest.raises(UsageError) as info:
        resolve_spec(spec, "data")
    text = str(info.value)
    assert message in text and repr(spec) in text and "--data" in text
    assert "module.path:attr or path/to/file.py:attr" in text


def test_import_failure_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('bad import')\n")
    with pytest.raises(UsageError, match=r"importing .*broken.py failed: RuntimeError: bad import"):
        resolve_model(f"{path}:build")
    # a failed import leaves nothing half-initialised behind: fixing the file fixes the spec
    path.write_text("import torch.nn as nn\nbuild = lambda: nn.Linear(1, 1)\n")
    assert isinstance(resolve_model(f"{path}:build"), nn.Linear)


def test_resolve_callable(specfile: str) -> None:
    assert resolve_callable("torch.nn.functional:mse_loss") is importlib.import_module(
        "torch.nn.functional"
    ).mse_loss
    with pytest.raises(UsageError, match=r"--loss .*NUMBER is a int, which is not callable"):
        resolve_callable(f"{specfile}:NUMBER")


def test_resolve_data_accepts_datasets_pairs_and_factories(specfile: str) -> None:
    train, evaluation = resolve_data("tests.user_models:lm_data")
    assert isinstance(train, TokenDataset) and isinstance(evaluation, TokenDataset)
    assert (len(train), len(evaluation)) == (64, 16)
    only, none = resolve_data("tests.user_models:TokenDataset")  # a class is a factory
    assert isinstance(only, TokenDataset) and none is None
    data, none = resolve_data(f"{specfile}:DATA")
    assert isinstance(data, TensorDataset) and none is None
    assert resolve_data(f"{specfile}:PAIR")[1] is not None
    assert resolve_data(f"{specfile}:PAIR_NO_EVAL")[1] is None
    assert all(isinstance(d, TensorDataset) for d in resolve_data(f"{specfile}:data"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.user_models:not_a_dataset", "not_a_dataset() returned a model (Linear)"),
        ("{file}:MODEL", "it names a model (Linear)"),
        ("{file}:SAMPLES", "it names a list of 2 items, not a Dataset"),
        ("{file}:BAD_EVAL", "the pair's second item (eval) is a int"),
        ("{file}:NUMBER", "it names a int, not a Dataset"),
    ],
)
def test_resolve_data_refuses_what_is_not_data(specfile: str, spec: str, message: str) -> None:
    spec = spec.format(file=specfile)
    with pytest.raises(DataError) as info:
        resolve_data(spec)
    text = str(info.value)
    assert message in text and spec in text and info.value.exit_code == 2
    assert "a Dataset, a (train, eval) pair of Datasets, or a function returning either" in text


def test_resolve_data_factory_failure(specfile: str) -> None:
    with pytest.raises(UsageError, match=r"--data .*broken\(\) failed: RuntimeError"):
        resolve_data(f"{specfile}:broken")


def test_is_dataset() -> None:
    assert is_dataset(TokenDataset(4))
    assert not is_dataset(TokenDataset)  # the class, not a dataset
    assert not is_dataset([1, 2]) and not is_dataset(nn.Linear(1, 1)) and not is_dataset("ab")


# ---------------------------------------------------- resolve_factory (doctor --model)
MODEL_SRC = "import torch.nn as nn\n\ndef build():\n    return nn.Linear(2, 2)\n\nVALUE = 3\n"


def test_resolve_factory_forms(tmp_path, monkeypatch):
    (tmp_path / "mymodels_a.py").write_text(MODEL_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert isinstance(resolve_factory("mymodels_a:build")(), nn.Linear)
    assert isinstance(resolve_factory(f"{tmp_path}/mymodels_a.py:build")(), nn.Linear)
    assert resolve_factory("torch.nn:Linear") is nn.Linear
    assert resolve_factory("collections:OrderedDict.fromkeys") is not None


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "is not understood"),
        (":build", "is not understood"),
        ("mod:", "is not understood"),
        ("mod:a..b", "is not understood"),
        ("no_such_module_xyz:build", "no module named 'no_such_module_xyz'"),
        ("missing/file.py:build", "does not exist"),
        ("torch.nn:NoSuchThing", "has no attribute 'NoSuchThing'"),
        ("math:pi", "is not callable"),
    ],
)
def test_resolve_factory_errors(spec, message):
    with pytest.raises(UsageError) as info:
        resolve_factory(spec)
    assert message in str(info.value) and repr(spec) in str(info.value)
    assert info.value.exit_code == 2


def test_resolve_factory_broken_file(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('bad import')\n")
    with pytest.raises(UsageError, match="bad import"):
        resolve_factory(f"{path}:build")
