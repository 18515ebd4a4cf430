"""Resolve ``module:attr`` specs (``--model``, ``--data``, ``--loss``, ``--optimizer``) to objects.

A spec names an attribute of an importable module or of a Python file:

- ``package.module:attr`` (dotted attributes allowed: ``package.module:Class.builder``),
  imported with :func:`importlib.import_module` from the Python path;
- ``path/to/file.py:attr``, loaded with :mod:`importlib` under a module name unique to
  the file's resolved path (two files both named ``model.py`` do not clash; loading the
  same file twice returns the same module).

Entry points:

- :func:`resolve_spec`: the object itself;
- :func:`resolve_callable`: the object, which must be callable (a factory, a loss);
- :func:`resolve_factory`: a model factory, resolved but not called;
- :func:`resolve_model`: an ``nn.Module`` (a module object as it is, or a zero-argument
  factory called once);
- :func:`resolve_data`: ``(train, eval or None)`` datasets (a Dataset, a pair, or a
  zero-argument factory returning either).

Every failure is a :class:`~torchgpu.errors.UsageError` (or :class:`DataError` for data of
the wrong kind), exit code 2, in one paragraph naming the spec, what was found and the fix.
This module is library code: the CLI uses it, it never imports the CLI.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from torch import Tensor, nn
from torch.utils.data import Dataset

from torchgpu.errors import DataError, TorchGpuError, UsageError, first_line
from torchgpu.user_files import check_file, show

#: What each kind of spec must name, for error messages.
WANTS = {
    "model": "an nn.Module or a function returning one",
    "data": "a Dataset, a (train, eval) pair of Datasets, or a function returning either",
    "loss": "a function loss(output, target) -> Tensor",
    "optimizer": "a function optimizer(params) -> torch.optim.Optimizer, or an Optimizer class",
    "scheduler": "a function scheduler(optimizer) -> torch.optim.lr_scheduler.LRScheduler",
    "metrics": "a function fn(output, target) -> float or a class with reset(), "
               "update(output, target) and compute()",
}


def _flag(what: str) -> str:
    return f"--{what}"


def _forms(what: str) -> str:
    return (
        f"module.path:attr or path/to/file.py:attr, where attr is "
        f"{WANTS.get(what, 'the object to use')}"
    )


def _load_file(path_text: str, spec: str, what: str) -> ModuleType:
    path = check_file(Path(path_text).expanduser(), what=f"{_flag(what)} {show(spec)!r}: file",
                      fix=f"Use {_forms(what)}.")
    # A stable name unique to the file, so two files called model.py do not clash and a
    # second resolution of the same file reuses the module (its classes stay identical).
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"_torchgpu_spec_{path.stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise UsageError(
            f"{_flag(what)} {spec!r}: {path_text} cannot be imported as Python: name a .py file"
        )
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look it up
    try:
        loader_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise UsageError(
            f"{_flag(what)} {spec!r}: importing {path_text} failed: {first_line(error)}. "
            "Fix the file so that it imports on its own."
        ) from error
    return module


def _load_module(name: str, spec: str, what: str) -> ModuleType:
    # The working directory is importable, as with `python -m` (a console script's
    # sys.path starts at its own bin directory): `torchgpu train --model mypkg.net:build`
    # run from a project's root finds mypkg there.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and name.startswith(error.name):
            raise UsageError(
                f"{_flag(what)} {spec!r}: no module named {name!r} on the Python path. Use "
                f"{_forms(what)}, or set PYTHONPATH to the directory holding it."
            ) from None
        raise UsageError(
            f"{_flag(what)} {spec!r}: importing {name} failed: {first_line(error)}. Install "
            "what it imports, or fix the import."
        ) from error
    except Exception as error:
        raise UsageError(
            f"{_flag(what)} {spec!r}: importing {name} failed: {first_line(error)}. Fix the "
            "module so that it imports on its own."
        ) from error


def resolve_spec(spec: str, what: str = "model") -> object:
    """The object ``spec`` (``module.path:attr`` or ``path/to/file.py:attr``) names.

    ``what`` (``model``, ``data``, ``loss``...) only words the errors (``--model ...``).
    Raises :class:`UsageError` for a malformed spec, a module or file that does not exist
    or fails to import, or a missing attribute.
    """
    where, sep, attribute = spec.rpartition(":")
    if not sep or not where or not attribute or not all(attribute.split(".")):
        raise UsageError(f"{_flag(what)} {spec!r} is not understood: use {_forms(what)}.")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(where, spec, what)
    else:
        module = _load_module(where, spec, what)
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise UsageError(
                f"{_flag(what)} {spec!r}: {where} has no attribute {attribute!r}. Use "
                f"{_forms(what)}."
            )
        value = getattr(value, part)
    return value


def resolve_callable(spec: str, what: str = "loss") -> Callable[..., Any]:
    """The callable ``spec`` names (a factory, a loss function, a class).

    Raises :class:`UsageError` as :func:`resolve_spec` does, or when the object is not
    callable.
    """
    value = resolve_spec(spec, what)
    if not callable(value):
        attribute = spec.rpartition(":")[2]
        raise UsageError(
            f"{_flag(what)} {spec!r}: {attribute} is a {type(value).__name__}, which is not "
            f"callable. Use {_forms(what)}."
        )
    return value


def resolve_factory(spec: str) -> Callable[[], nn.Module]:
    """The model factory ``spec`` names (``--model`` of ``torchgpu doctor``), not called.

    Raises :class:`UsageError` (exit 2) for a malformed spec, a module or file that
    cannot be imported, a missing attribute or a non-callable one.
    """
    factory: Callable[[], nn.Module] = resolve_callable(spec, "model")  # Callable[..., Any]
    return factory


def _call(factory: Callable[[], Any], spec: str, what: str) -> Any:
    name = spec.rpartition(":")[2]
    try:
        return factory()
    except TorchGpuError:
        raise
    except Exception as error:
        raise UsageError(
            f"{_flag(what)} {spec}: {name}() failed: {first_line(error)}. Fix the factory so "
            f"that it returns {WANTS.get(what, 'the object')} when called without arguments."
        ) from error


def resolve_model(spec: str) -> nn.Module:
    """The ``nn.Module`` ``spec`` names: a module object as it is, or the result of calling
    a zero-argument factory (a function or a class) once.

    Raises :class:`UsageError` for a spec :func:`resolve_spec` refuses, a factory that
    raises (its error is chained), or anything that is not (or does not build) a module.
    """
    value = resolve_spec(spec, "model")
    if isinstance(value, nn.Module):
        return value
    if not callable(value):
        raise UsageError(
            f"--model {spec!r} names a {type(value).__name__}, neither an nn.Module nor a "
            f"factory. Use {_forms('model')}."
        )
    model = _call(value, spec, "model")
    if not isinstance(model, nn.Module):
        raise UsageError(
            f"--model {spec} returned a {type(model).__name__}, not an nn.Module: the factory "
            "must return the model, e.g. def build() -> nn.Module"
            + ("; blocks go in an nn.ModuleList or nn.Sequential, not a Python list."
               if isinstance(model, list | tuple) else ".")
        )
    return model


def is_dataset(value: object) -> bool:
    """A torch ``Dataset`` or a map-style stand-in (``__len__`` and ``__getitem__``); not a
    model, a tensor, a container of samples (tuple, list, dict) or a string."""
    if isinstance(value, type | nn.Module | Tensor | tuple | list | Mapping | str | bytes):
        return False
    if isinstance(value, Dataset):
        return True
    return hasattr(value, "__getitem__") and hasattr(value, "__len__")


def _refuse_data(spec: str, value: object, role: str) -> DataError:
    kind = type(value).__name__
    if isinstance(value, nn.Module):
        found = f"a model ({kind})"
        fix = "the model goes to --model; the data spec must return the data"
    elif isinstance(value, list | tuple):
        found = f"a {kind} of {len(value)} items"
        fix = (
            "return a Dataset (e.g. torch.utils.data.TensorDataset) or a (train, eval) pair "
            "of Datasets"
        )
    else:
        found = f"a {kind}"
        fix = "return a map-style torch.utils.data.Dataset (with __len__ and __getitem__)"
    return DataError(
        f"--data {spec}: {role} {found}, not a Dataset. It must be {WANTS['data']}: {fix}."
    )


def resolve_data(spec: str) -> tuple[Any, Any | None]:
    """The ``(train, eval)`` datasets ``spec`` names; ``eval`` is None when only one
    dataset is given.

    Accepted: a Dataset; a ``(train, eval)`` tuple or list (``eval`` may be None); or a
    zero-argument factory (function or class) returning either. Refused with
    :class:`DataError`: a model, a tensor, a list of samples, anything else; with
    :class:`UsageError`: a spec :func:`resolve_spec` refuses, a factory that raises.
    """
    value = resolve_spec(spec, "data")
    role = "it names"
    if isinstance(value, nn.Module):
        raise _refuse_data(spec, value, role)
    if callable(value) and not is_dataset(value) and not isinstance(value, tuple | list):
        value = _call(value, spec, "data")
        role = f"{spec.rpartition(':')[2]}() returned"
    if is_dataset(value):
        return value, None
    if isinstance(value, tuple | list) and len(value) == 2 and is_dataset(value[0]):
        train, evaluation = value
        if evaluation is not None and not is_dataset(evaluation):
            raise _refuse_data(spec, evaluation, "the pair's second item (eval) is")
        return train, evaluation
    raise _refuse_data(spec, value, role)


__all__ = [
    "WANTS",
    "is_dataset",
    "resolve_callable",
    "resolve_data",
    "resolve_model",
    "resolve_spec",
]
