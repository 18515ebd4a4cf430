"""Resolve a ``module:factory`` spec (``--model``) to a callable that builds an nn.Module.

Accepted forms: ``package.module:factory``, ``package.module:Class.builder`` (dotted
attributes) and ``path/to/file.py:factory``. Shared by every verb taking ``--model``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from torch import nn

from torchgpu.errors import UsageError

FORMS = "module.path:factory or path/to/file.py:factory (factory builds an nn.Module)"


def _load_file(path_text: str, spec: str) -> ModuleType:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UsageError(f"--model {spec!r}: file {path_text} does not exist. Use {FORMS}")
    # A stable, unique module name per file, so two files named model.py do not clash.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"_torchgpu_model_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(f"--model {spec!r}: {path_text} cannot be imported as Python")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise UsageError(
            f"--model {spec!r}: importing {path_text} failed: {type(error).__name__}: {error}"
        ) from error
    return module


def _load_module(name: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and name.startswith(error.name):
            raise UsageError(
                f"--model {spec!r}: no module named {name!r} on the Python path. Use {FORMS}, "
                "or set PYTHONPATH to the directory holding it"
            ) from None
        raise UsageError(f"--model {spec!r}: importing {name} failed: {error}") from error
    except Exception as error:
        raise UsageError(
            f"--model {spec!r}: importing {name} failed: {type(error).__name__}: {error}"
        ) from error


def resolve_factory(spec: str) -> Callable[[], nn.Module]:
    """The callable ``spec`` names. Raises UsageError (exit 2) for a malformed spec, a
    module or file that cannot be imported, a missing attribute or a non-callable one."""
    where, sep, attribute = spec.rpartition(":")
    if not sep or not where or not attribute or not all(attribute.split(".")):
        raise UsageError(f"--model {spec!r} is not understood: use {FORMS}")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(where, spec)
    else:
        module = _load_module(where, spec)
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise UsageError(
                f"--model {spec!r}: {where} has no attribute {attribute!r}. Use {FORMS}"
            )
        value = getattr(value, part)
    if not callable(value):
        raise UsageError(f"--model {spec!r}: {attribute} is not callable. Use {FORMS}")
    return cast(Callable[[], nn.Module], value)
