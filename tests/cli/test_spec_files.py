"""Spec files (``--model/--data/--loss path/file.py:attr``) are imported the way Python
runs a script: their directory goes first on ``sys.path`` (``import helper`` finds the
``helper.py`` beside them, in DataLoader workers and DDP ranks too), ``sys.argv`` is the
file alone while they import (a module-level ``argparse`` with defaults parses nothing of
torchgpu's), and one that ends the program while imported (``sys.exit(3)``, an argparse
error) is named in one paragraph, exit 2, never a silent exit with its code."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import run_cli, run_main
from torchgpu.errors import UsageError

run = run_main  # torchgpu ARGV in this process: (exit code, stderr)

PAIRS = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

def model():
    torch.manual_seed(0)
    return nn.Linear(4, 1)

def data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
"""


@pytest.fixture(autouse=True)
def clean_imports(tmp_path: Path) -> Iterator[None]:
    """Each test's spec files and their siblings leave sys.path and sys.modules as they
    were (the next test's ``helper`` must not be this one's); torch's own lazy imports
    stay."""
    path, argv = list(sys.path), list(sys.argv)
    yield
    sys.path[:] = path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]
    assert sys.argv == argv


def one_paragraph(err: str) -> bool:
    return len([line for line in err.strip().splitlines() if line.strip()]) == 1


def train(tmp_path: Path, model: str, data: str, *flags: str) -> list[str]:
    return ["train", "--model", model, "--data", data, "--loss", "mse", "--epochs", "1",
            "--batch-size", "8", "--device", "cpu", "--progress", "off",
            "--out", str(tmp_path / "out"), *flags]


@pytest.mark.parametrize(("code", "shown"), [
    ("import sys\nsys.exit(3)\n", "sys.exit(3)"),
    ("raise SystemExit\n", "sys.exit()"),
    ("import sys\nsys.exit('no GPU here')\n", "sys.exit('no GPU here')"),
])
def test_a_spec_file_that_exits_while_imported_is_named(
        code: str, shown: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "pairs.py").write_text(PAIRS)
    spec = tmp_path / "exits.py"
    spec.write_text(code)
    code_, err = run(train(tmp_path, f"{spec}:model", f"{tmp_path / 'pairs.py'}:data"), capsys)
    assert code_ == 2 and one_paragraph(err), err
    assert f"--model '{spec}:model': importing {spec} ended the program with {shown}" in err
    assert "__main__" in err
    assert not (tmp_path / "out").exists()


def test_module_level_argparse_with_defaults_imports_with_the_file_as_argv(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torchgpu's own flags (--model ... --epochs 1) are not the spec's: its parser sees
    ``[file]`` alone, and its defaults apply."""
    spec = tmp_path / "argp.py"
    spec.write_text("import argparse, sys\n"
                    "parser = argparse.ArgumentParser()\n"
                    "parser.add_argument('--width', type=int, default=3)\n"
                    "ARGS = parser.parse_args()\nARGV = list(sys.argv)\n" + PAIRS)
    code, err = run(train(tmp_path, f"{spec}:model", f"{spec}:data"), capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["steps"] == 3
    from torchgpu.factories import resolve_spec

    assert resolve_spec(f"{spec}:ARGV") == [str(spec)]
    assert resolve_spec(f"{spec}:ARGS").width == 3


def test_argparse_with_a_required_argument_is_named_after_its_own_complaint(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "needs.py"
    spec.write_text("import argparse\nparser = argparse.ArgumentParser()\n"
                    "parser.add_argument('--width', type=int, required=True)\n"
                    "parser.parse_args()\n" + PAIRS)
    code, err = run(train(tmp_path, f"{spec}:model", f"{spec}:data"), capsys)
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert f"--data '{spec}:data'" in last and "sys.exit(2)" in last  # data resolves first
    assert "required: --width" in err  # argparse's own line, about the spec's argument
    assert "unrecognized arguments" not in err


def test_a_factory_that_exits_or_parses_arguments_is_named(tmp_path: Path) -> None:
    from torchgpu.factories import resolve_model

    spec = tmp_path / "f.py"
    spec.write_text("import sys, argparse\nfrom torch import nn\n"
                    "def quits():\n    sys.exit(4)\n"
                    "def parses():\n    p = argparse.ArgumentParser()\n"
                    "    p.add_argument('--width', type=int, default=2)\n"
                    "    return nn.Linear(p.parse_args().width, 1)\n")
    with pytest.raises(UsageError, match=r"quits\(\) ended the program with sys.exit\(4\)"):
        resolve_model(f"{spec}:quits")
    assert resolve_model(f"{spec}:parses").in_features == 2


def test_a_module_spec_that_exits_while_imported_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchgpu.factories import resolve_spec

    (tmp_path / "quitting_module_xyz.py").write_text("import sys\nsys.exit(5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match=r"importing quitting_module_xyz ended the program "
                                         r"with sys\.exit\(5\)"):
        resolve_spec("quitting_module_xyz:model")


# ------------------------------------------------------------------ siblings on sys.path
def sibling_project(root: Path, helper: str, value: int) -> Path:
    """``root/model.py`` importing ``helper`` (``root/<helper>.py``), and data whose items
    import another sibling only when read (after the import, in DataLoader workers)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{helper}.py").write_text(f"VALUE = {value}\n")
    (root / f"{helper}_late.py").write_text(f"VALUE = {value}\n")
    (root / "model.py").write_text(
        f"import {helper}\n" + PAIRS + f"""
class Lazy(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        import {helper}_late as again  # at item time: in a worker process too
        return torch.full((4,), float(again.VALUE)), torch.ones(1)

def lazy():
    return Lazy()

WIDTH = {helper}.VALUE
""")
    return root / "model.py"


def test_a_spec_file_imports_the_module_beside_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = sibling_project(tmp_path / "proj", "helper_beside", 7)
    code, err = run(train(tmp_path, f"{spec}:model", f"{spec}:lazy", "--num-workers", "2"),
                    capsys)
    assert code == 0, err
    from torchgpu.factories import resolve_spec

    assert resolve_spec(f"{spec}:WIDTH") == 7


def test_siblings_of_one_name_in_two_spec_directories_are_refused(tmp_path: Path) -> None:
    from torchgpu.factories import resolve_spec

    first = sibling_project(tmp_path / "a", "helper_twice", 1)
    second = sibling_project(tmp_path / "b", "helper_twice", 2)
    assert resolve_spec(f"{first}:WIDTH") == 1
    with pytest.raises(UsageError) as refused:
        resolve_spec(f"{second}:WIDTH")
    message = str(refused.value)
    assert str(tmp_path / "b" / "helper_twice.py") in message
    assert str(tmp_path / "a" / "helper_twice.py") in message
    assert "one module per name" in message and "\n" not in message


def test_a_failed_spec_import_leaves_its_directory_off_the_path(tmp_path: Path) -> None:
    from torchgpu.factories import resolve_spec

    spec = tmp_path / "broken.py"
    spec.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(UsageError, match="boom"):
        resolve_spec(f"{spec}:model")
    assert str(tmp_path) not in sys.path


@pytest.mark.slow
def test_ddp_ranks_import_the_module_beside_the_spec(tmp_path: Path) -> None:
    spec = sibling_project(tmp_path / "proj", "helper_ranks", 5)
    done = run_cli(train(tmp_path, f"{spec}:model", f"{spec}:lazy", "--nproc", "2",
                         "--strategy", "ddp"), timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["world_size"] == 2
