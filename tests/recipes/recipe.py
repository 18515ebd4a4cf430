"""Helpers of the recipe tests: load a script of examples/recipes/ as a module, count
its lines of user code, and read the counts examples/recipes/README.md states."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

from tests.procs import REPO

RECIPES = REPO / "examples" / "recipes"


def load(name: str) -> ModuleType:
    """``examples/recipes/<name>.py`` imported as a module (its ``__main__`` not run),
    with examples/recipes/ on ``sys.path`` as when the script runs (``import
    nanogpt_model``)."""
    if str(RECIPES) not in sys.path:
        sys.path.insert(0, str(RECIPES))
    path = RECIPES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up
    spec.loader.exec_module(module)
    return module


def code_lines(path: Path) -> int:
    """Lines of user code: not blank, not a comment, not part of a docstring."""
    text = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        first = body[0] if isinstance(body, list) and body else None
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return sum(1 for number, line in enumerate(text.splitlines(), 1)
               if line.strip() and not line.strip().startswith("#") and number not in docstrings)


def stated_lines(name: str) -> tuple[int, int]:
    """The (original, torchgpu) line counts examples/recipes/README.md states for
    recipe ``name`` (its table row starts with the recipe's file stem)."""
    readme = (RECIPES / "README.md").read_text()
    row = re.search(rf"^\| `{name}_\*\.py`.*?\| (\d+) \| (\d+) \|", readme, re.MULTILINE)
    assert row is not None, f"no row for {name} in examples/recipes/README.md"
    return int(row.group(1)), int(row.group(2))


def check_line_counts(name: str) -> None:
    """The README's counts are the files' counts."""
    counted = (code_lines(RECIPES / f"{name}_original.py"),
               code_lines(RECIPES / f"{name}_torchgpu.py"))
    assert stated_lines(name) == counted, f"examples/recipes/README.md: {name} has {counted}"
