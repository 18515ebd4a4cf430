"""The curated public API: at most 20 names, written once (the ``if TYPE_CHECKING`` block
of ``torchgpu/__init__.py``); every name in ``torchgpu.__all__`` resolves lazily, and
the lazy table, ``__all__`` and what the type checker reads list the same names."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torchgpu
from tests.procs import test_env


def _type_checker_view() -> dict[str, str]:
    """What mypy and IDEs read: the imports under ``if TYPE_CHECKING`` (parsed by ast)."""
    tree = ast.parse(Path(torchgpu.__file__).read_text())
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    return {alias.asname or alias.name: str(stmt.module) for stmt in block.body
            if isinstance(stmt, ast.ImportFrom) for alias in stmt.names}


def test_all_matches_the_lazy_table() -> None:
    assert set(torchgpu.__all__) - {"__version__"} == set(torchgpu._API)


def test_the_lazy_table_is_the_type_checkers_view() -> None:
    view = _type_checker_view()
    assert view == torchgpu._API
    assert all(stmt.names[0].asname == stmt.names[0].name for stmt in ast.walk(
        ast.parse(Path(torchgpu.__file__).read_text())) if isinstance(stmt, ast.ImportFrom)
        and stmt.module and stmt.module.startswith("torchgpu"))  # re-exported explicitly


def test_at_most_20_public_names() -> None:
    assert len(torchgpu._API) <= 20, sorted(torchgpu._API)


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
