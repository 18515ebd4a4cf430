"""Helper of the Hugging Face recipe tests: import a recipe as its script runs (the line
counts are checked by :mod:`tests.recipes.recipe`)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"


def recipe(monkeypatch: pytest.MonkeyPatch, name: str) -> ModuleType:
    """``examples/recipes/<name>.py`` imported with its directory first on ``sys.path``,
    as ``python examples/recipes/<name>.py`` runs it (it imports ``hf_tiny``)."""
    monkeypatch.syspath_prepend(str(RECIPES))
    return importlib.import_module(name)
