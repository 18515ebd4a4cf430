"""Helpers of the Hugging Face recipe tests: import a recipe as its script runs, and
count its lines of code as examples/recipes/README.md states them."""

from __future__ import annotations

import ast
import importlib
import io
import re
import tokenize
from pathlib import Path
from types import ModuleType

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"


def recipe(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """``examples/recipes/<name>.py`` imported with its directory first on ``sys.path``,
    as ``python examples/recipes/<name>.py`` runs it (it imports ``hf_tiny``)."""
    monkeypatch.syspath_prepend(str(RECIPES))
    return importlib.import_module(name)


def code_lines(name: str) -> int:
    """Lines of code of ``examples/recipes/<name>.py``: lines holding a token that is not
    a comment, a blank or a docstring."""
    source = (RECIPES / f"{name}.py").read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            end = body[0].end_lineno or body[0].lineno
            docstrings.update(range(body[0].lineno, end + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
            tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            lines.update(range(token.start[0], token.end[0] + 1))
    return len(lines - docstrings)


def readme_counts(recipe_name: str) -> tuple[int, int]:
    """The (original, torchgpu) line counts examples/recipes/README.md states for the
    table row whose first cell names ``recipe_name``."""
    for row in (RECIPES / "README.md").read_text().splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) >= 3 and recipe_name in cells[0]:
            original, ported = (int(re.sub(r"\D", "", c)) for c in cells[1:3])
            return original, ported
    raise AssertionError(f"examples/recipes/README.md has no row for {recipe_name}")
