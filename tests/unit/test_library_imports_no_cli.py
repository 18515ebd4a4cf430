"""The library never imports the CLI: no module outside ``torchgpu/cli`` imports
``torchgpu.cli``, at module level, inside functions or under ``TYPE_CHECKING``.

Read with :mod:`ast`, so an import that only runs on some path still counts; so do
relative imports and ``importlib.import_module("torchgpu.cli...")``. The one exception
is ``torchgpu/__main__.py``: ``python -m torchgpu`` is the command line itself.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import torchgpu

PACKAGE = Path(torchgpu.__file__).parent
ALLOWED = {PACKAGE / "__main__.py"}


def _module_name(file: Path) -> str:
    parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(source: str, name: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, dotted name) of everything module ``name`` imports, however it does."""
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            yield from ((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value


def _is_cli(name: str) -> bool:
    return name == "torchgpu.cli" or name.startswith("torchgpu.cli.")


def cli_imports_outside_cli() -> list[str]:
    """``path:line imports NAME`` for each import of the CLI from library code."""
    found = []
    for file in sorted(PACKAGE.rglob("*.py")):
        if file in ALLOWED or (PACKAGE / "cli") in file.parents:
            continue
        source = file.read_text(encoding="utf-8")
        for line, name in _imported(source, _module_name(file), file.name == "__init__.py"):
            if _is_cli(name):
                found.append(f"{file.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return found


def test_library_never_imports_the_cli() -> None:
    found = cli_imports_outside_cli()
    assert not found, (
        "library modules import the CLI (move what they need into the library):\n"
        + "\n".join(found)
    )


def test_the_check_sees_every_form_of_import() -> None:
    """The walker itself: each way of importing the CLI is seen, lookalikes are not."""
    sample = (
        "import torchgpu.cli.common\n"
        "from torchgpu.cli import common\n"
        "from ..cli.common import make_console\n"
        "from .. import cli\n"
        "def later():\n"
        "    from torchgpu.cli.common_model import resolve_factory\n"
        "    importlib.import_module('torchgpu.cli.devices')\n"
        "import torchgpu.client_side\n"
        "from torchgpu.devices import cli_name\n"
    )
    names = [name for _, name in _imported(sample, "torchgpu.planning.sample") if _is_cli(name)]
    assert names == [
        "torchgpu.cli.common",
        "torchgpu.cli.common",
        "torchgpu.cli.common.make_console",
        "torchgpu.cli",
        "torchgpu.cli.common_model.resolve_factory",
        "torchgpu.cli.devices",
    ]
