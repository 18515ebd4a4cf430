"""Resolve ``module:attr`` specs (``--model``, ``--data``, ``--loss``, ``--optimizer``) to objects.

A spec names an attribute of an importable module or of a Python file:

- ``package.module:attr`` (dotted attributes allowed: ``package.module:Class.builder``),
  imported with :func:`importlib.import_module` from the Python path;
- ``path/to/file.py:attr``, loaded with :mod:`importlib` under a module name unique to
  the file's resolved path (two files both named ``model.py`` do not clash; loading the
  same file twice returns the same module). As for a script, the file's directory goes
  first on ``sys.path`` (and stays, so DataLoader workers and lazy imports find it too):
  ``import helper`` finds the ``helper.py`` beside it. Python keeps one module per name,
  so two spec files in different directories whose siblings share a name (``a/helper.py``,
  ``b/helper.py``) would share the first one imported: that is refused, naming both.

While a spec is imported, and while its factory runs, ``sys.argv`` is ``[spec's file or
module]`` alone (as for a script run without arguments): a module-level ``argparse``
with defaults parses nothing of torchgpu's own command line. A spec that ends the
program meanwhile (``sys.exit(3)``, an ``argparse`` error) is a :class:`UsageError`
naming it and what it did, not a silent exit with its code.

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
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
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
    "collate-fn": "a collate function fn(items) -> batch, or a zero-argument factory "
                  "returning one",
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


def _exit_call(exited: SystemExit) -> str:
    """``sys.exit(...)`` as the code that raised ``exited`` called it."""
    return "sys.exit()" if exited.code is None else f"sys.exit({exited.code!r})"


@contextmanager
def _as_spec(argv0: str, doing: str, spec: str, what: str) -> Iterator[None]:
    """Inside the block (a spec's import, or its factory's call): ``sys.argv`` is
    ``[argv0]``, put back after; a ``SystemExit`` raised there (a module-level
    ``argparse`` failing, a ``sys.exit``) is a UsageError naming the spec and what it did,
    rather than torchgpu ending silently with the spec's exit code."""
    saved = sys.argv
    sys.argv = [argv0]
    try:
        yield
    except SystemExit as exited:
        raise UsageError(
            f"{_flag(what)} {spec!r}: {doing} ended the program with {_exit_call(exited)} "
            f"(SystemExit). A spec is imported and called, not run as a script: torchgpu "
            f"gives it sys.argv = [{argv0!r}], so an argparse parser sees no arguments and "
            "must have defaults for all of them. Move the exit and the argument parsing under "
            "`if __name__ == \"__main__\":`, or give every argument a default."
        ) from None
    finally:
        sys.argv = saved


def _on_path(directory: Path) -> bool:
    """Put ``directory`` first on ``sys.path`` (as Python does for a script's directory);
    True when it was not there before."""
    entry = str(directory)
    if entry in sys.path:
        return False
    sys.path.insert(0, entry)
    return True


def _check_siblings(module: ModuleType, directory: Path, spec: str, what: str) -> None:
    """UsageError when ``module`` (a spec file in ``directory``) uses a module whose name
    a file beside it has, but which was imported from elsewhere (another spec's
    directory imported its own sibling of that name first: Python keeps one per name)."""
    for value in list(vars(module).values()):
        try:  # any object may stand in a module's namespace, with any attributes
            name = value.__name__ if isinstance(value, ModuleType) else getattr(
                value, "__module__", None)
        except Exception:
            continue
        if not isinstance(name, str) or name.startswith("_torchgpu_spec_"):
            continue
        top = name.partition(".")[0]
        beside = [p for p in (directory / f"{top}.py", directory / top / "__init__.py")
                  if p.is_file()]
        loaded = getattr(sys.modules.get(top), "__file__", None)
        if not beside or not isinstance(loaded, str):
            continue
        if Path(loaded).resolve() not in {p.resolve() for p in beside}:
            raise UsageError(
                f"{_flag(what)} {spec!r}: it imports {top}, and {show(beside[0])} stands "
                f"beside it, but the module {top} in use was imported from {show(loaded)} "
                "(Python keeps one module per name; another spec's directory, or the Python "
                f"path, gave it first). Rename one of the two {top} modules, or make the "
                "directories packages and use module specs (package.module:attr)."
            )


def _load_file(path_text: str, spec: str, what: str) -> ModuleType:
    path = check_file(Path(path_text).expanduser(), what=f"{_flag(what)} {show(spec)!r}: file",
                      fix=f"Use {_forms(what)}.")
    # A stable name unique to the file, so two files called model.py do not clash and a
    # second resolution of the same file reuses the module (its classes stay identical).
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:12]
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
    added = _on_path(resolved.parent)  # `import helper` finds helper.py beside the file
    try:
        with _as_spec(str(path), f"importing {path_text}", spec, what):
            try:
                loader_spec.loader.exec_module(module)
            except Exception as error:
                raise UsageError(
                    f"{_flag(what)} {spec!r}: importing {path_text} failed: "
                    f"{first_line(error)}. Fix the file so that it imports on its own."
                ) from error
        _check_siblings(module, resolved.parent, spec, what)
    except BaseException:  # the import did not happen: leave no half of it behind
        sys.modules.pop(name, None)
        if added and str(resolved.parent) in sys.path:
            sys.path.remove(str(resolved.parent))
        raise
    return module


def _load_module(name: str, spec: str, what: str) -> ModuleType:
    # The working directory is importable, as with `python -m` (a console script's
    # sys.path starts at its own bin directory): `torchgpu train --model mypkg.net:build`
    # run from a project's root finds mypkg there.
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    with _as_spec(name, f"importing {name}", spec, what):
        return _import(name, spec, what)


def _import(name: str, spec: str, what: str) -> ModuleType:
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
    where, _, name = spec.rpartition(":")
    try:
        with _as_spec(where, f"{name}()", spec, what):
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
