"""The curated public API: at most 20 names, written once (the ``if TYPE_CHECKING`` block
of ``torchgpu/__init__.py``); every name in ``torchgpu.__all__`` resolves lazily, and
the lazy table, ``__all__`` and what the type checker reads list the same names. The
subpackages that export lazily (devices, memory, train) use the same one list."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import torchgpu
from tests.procs import test_env
from torchgpu._lazy import export_table

LAZY = ["torchgpu", "torchgpu.devices", "torchgpu.memory", "torchgpu.train"]


def _type_checker_view(package: ModuleType) -> dict[str, str]:
    """What mypy and IDEs read: the imports under ``if TYPE_CHECKING`` (parsed by ast)."""
    tree = ast.parse(Path(str(package.__file__)).read_text())
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {alias.asname or alias.name: str(stmt.module) for stmt in block.body
            if isinstance(stmt, ast.ImportFrom) for alias in stmt.names}


@pytest.mark.parametrize("name", LAZY)
def test_all_and_the_lazy_table_are_the_type_checkers_view(name: str) -> None:
    package = importlib.import_module(name)
    table = export_table(str(package.__file__))
    assert table == _type_checker_view(package)
    assert set(package.__all__) - {"__version__"} == set(table)
    assert sorted(dir(package)) == sorted(package.__all__)
    for export in table:  # each resolves, from the module the block names
        assert getattr(package, export) is getattr(importlib.import_module(table[export]),
                                                   export)
    tree = ast.parse(Path(str(package.__file__)).read_text())
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    assert all(alias.asname == alias.name for stmt in block.body  # re-exported explicitly
               if isinstance(stmt, ast.ImportFrom) for alias in stmt.names)


def test_at_most_20_public_names() -> None:
    assert len(export_table(str(torchgpu.__file__))) <= 20


# checked by the session's one mypy run (tests/conftest.py: mypy_report)
MYPY_SNIPPETS = {"user.py": "import torchgpu\nimport torchgpu.devices\n"
                            "ok = torchgpu.to_device\nbad = torchgpu.to_devcie\n"
                            "worse = torchgpu.devices.lst_devices\n"}


def test_the_type_checker_refuses_a_misspelt_name(mypy_report: dict[str, list[str]]) -> None:
    # __getattr__ is out of the type checker's sight: a typo is an error, not Any.
    out = "\n".join(mypy_report["user.py"])
    assert 'no attribute "to_devcie"' in out, "\n".join(mypy_report[""])
    assert 'no attribute "lst_devices"' in out
    assert "user.py:3:" not in out  # the real name type-checks


def test_an_export_block_is_required(tmp_path: Path) -> None:
    init = tmp_path / "__init__.py"
    init.write_text("from typing import TYPE_CHECKING\n")
    with pytest.raises(ImportError, match="export block"):
        export_table(str(init))


def test_demoted_names_live_in_their_submodules() -> None:
    from torchgpu.devices import DeviceInfo, default_device, parse_visible_devices
    from torchgpu.distributed import DistEnv
    from torchgpu.transfer import pin

    assert all((DeviceInfo, default_device, parse_visible_devices, DistEnv, pin))


def test_every_public_name_resolves() -> None:
    for name in torchgpu.__all__:
        assert getattr(torchgpu, name) is not None, name


def test_unknown_name_raises_attribute_error() -> None:
    try:
        torchgpu.no_such_thing  # noqa: B018
    except AttributeError as error:
        assert "no_such_thing" in str(error)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_resolving_the_whole_api_does_not_start_cuda() -> None:
    code = (
        "import torch, torchgpu\n"
        "[getattr(torchgpu, n) for n in torchgpu.__all__]\n"
        "assert not torch.cuda.is_initialized()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=test_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
