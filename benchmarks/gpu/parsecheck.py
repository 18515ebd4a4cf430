"""Check a kit command against the code it will run, without running it.

- ``python3 -m torchgpu VERB ...``: the verb's own parser (whatever builds it: a
  ``_parser()`` or ``main``) parses the arguments; ``train`` is then validated as
  ``torchgpu train`` validates it (flag combinations, choices), and ``bench`` has its
  suite and size checked.
- ``python3 path/to/script.py ...``: the script exists, compiles, and its own argparse
  accepts the arguments.
- ``python3 -m pytest ...``: pytest itself parses the flags, with its plugins and the
  repository's ini and conftest (:mod:`pytest_argcheck`, in a subprocess, stopped before
  collection), and every test path it names exists.
- every ``--device``/``--devices`` value (comma-separated lists too) has a form torchgpu
  accepts (``cpu``, ``cuda``, ``cuda:N``...; availability is not checked), and
  ``--model``/``--data``/``--loss`` specs (``path.py:attr``, ``module:attr``) resolve with
  :func:`torchgpu.factories.resolve_spec` (imported, not called: no data is built);
- the step's environment names only variables the code reads (:func:`known_env_names`).

Each check raises :class:`CommandError` naming the command and what is wrong. Parsers are
stopped right after parsing (nothing is trained, benchmarked or printed).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import importlib
import importlib.util
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# Variables a step may set that no torchgpu constant names: Python's, CUDA's, torch's.
STANDARD_ENV = frozenset({
    "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONPATH", "MPLBACKEND", "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING",
    "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_TRACE_BUFFER_SIZE", "NCCL_DEBUG",
})
SPEC_FLAGS = {"model": "model", "data": "data", "loss": "loss"}  # namespace attr -> what


class CommandError(Exception):
    pass


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


@contextlib.contextmanager
def _stop_after_parse() -> Iterator[None]:
    """Make every ``ArgumentParser.parse_args`` raise :class:`_Parsed` with its result."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self: argparse.ArgumentParser, args: Any = None,
                   namespace: Any = None) -> argparse.Namespace:
        raise _Parsed(original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]


def parse_with(main: Any, argv: Sequence[str], what: str) -> argparse.Namespace:
    """Run ``main(argv)`` until its parser has parsed ``argv``; the namespace, or
    :class:`CommandError` with argparse's message."""
    err = io.StringIO()
    try:
        with _stop_after_parse(), contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            main(list(argv))
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as exit_:
        raise CommandError(f"{what}: its parser refused the arguments (exit {exit_.code}): "
                           f"{err.getvalue().strip()}") from None
    raise CommandError(f"{what}: returned without parsing its arguments")


def check_torchgpu(argv: Sequence[str], repo: Path = HERE.parent.parent
                   ) -> argparse.Namespace:
    """``argv`` after ``python3 -m torchgpu``."""
    from torchgpu.cli.main import VERBS

    what = "torchgpu " + " ".join(argv)
    if not argv or argv[0] not in VERBS:
        raise CommandError(f"{what}: no such verb (the verbs are {', '.join(VERBS)})")
    module = importlib.import_module(VERBS[argv[0]][0])
    namespace = parse_with(module.main, argv[1:], what)
    try:
        if argv[0] == "train":
            from torchgpu.cli.train_flags import config_from_argv
            from torchgpu.train.config_checks import validate

            validate(config_from_argv(list(argv[1:])))
        elif argv[0] == "bench":
            from torchgpu.bench.runner import check_size, check_suite

            if namespace.suite != "all":
                check_size(check_suite(namespace.suite), namespace.size)
    except Exception as error:  # a TorchGpuError or argparse's exit: either way, refused
        raise CommandError(f"{what}: refused: {error}") from error
    check_devices(namespace, what)
    check_specs(namespace, what, repo)
    return namespace


def check_devices(namespace: argparse.Namespace, what: str) -> None:
    """Every ``--device``/``--devices`` value has a form torchgpu accepts (each item of a
    comma-separated list; repeated flags too). Whether such a device exists here is not
    asked: the kit's commands name GPUs this machine may not have."""
    from torchgpu.devices.spec import _SPEC, ACCEPTED_SPECS

    for attr in ("device", "devices"):
        value = getattr(namespace, attr, None)
        values = value if isinstance(value, list) else [value]
        for item in (v for text in values if isinstance(text, str) for v in text.split(",")):
            if _SPEC.match(item.strip()) is None:
                raise CommandError(f"{what}: --{attr} {item!r} is not a device (use one of "
                                   f"{ACCEPTED_SPECS})")


def check_specs(namespace: argparse.Namespace, what: str, repo: Path) -> None:
    """``--model``/``--data``/``--loss`` values in spec form resolve, from the repository
    root as the kit runs them: the module or file imports and has the attribute."""
    from torchgpu.factories import resolve_spec

    for attr, kind in SPEC_FLAGS.items():
        value = getattr(namespace, attr, None)
        if not isinstance(value, str) or ":" not in value or value.endswith(".csv"):
            continue  # a built-in name (mse), a CSV file, or not given
        try:
            with contextlib.chdir(repo):
                resolve_spec(value, kind)
        except Exception as error:
            raise CommandError(f"{what}: --{attr} {value}: {error}") from error


def check_script(repo: Path, path: str, argv: Sequence[str]) -> argparse.Namespace:
    """A Python script of the repository: it exists, compiles, and its parser accepts
    ``argv`` (its ``main(argv)`` is called and stopped once the arguments are parsed)."""
    file = repo / path
    if not file.is_file():
        raise CommandError(f"{path}: no such script")
    try:
        compile(file.read_text(), str(file), "exec")
    except SyntaxError as error:
        raise CommandError(f"{path}: does not compile: {error}") from error
    spec = importlib.util.spec_from_file_location(f"_kit_{file.stem}", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while defined
    sys.path.insert(0, str(file.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(file.parent))
        sys.modules.pop(spec.name, None)
    if not hasattr(module, "main"):
        raise CommandError(f"{path}: has no main(argv) to check its arguments with")
    what = f"{path} {' '.join(argv)}"
    namespace = parse_with(module.main, argv, what)
    check_devices(namespace, what)
    return namespace


def check_pytest(repo: Path, argv: Sequence[str], timeout_s: float = 120) -> list[str]:
    """pytest parses ``argv`` as the kit would run it (every plugin's flags, the ini
    file, the conftests of the paths), its ``-m`` expression compiles, and every test path
    exists. Returns the paths. Runs pytest in a subprocess with :mod:`pytest_argcheck`,
    which stops it before collection (nothing is imported from the tests but conftest)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(repo / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "pytest_argcheck", *argv],
                          cwd=repo, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)
    from pytest_argcheck import MARK

    line = next((x for x in done.stdout.splitlines() if x.startswith(MARK)), None)
    if done.returncode != 0 or line is None:
        said = (done.stderr.strip() or done.stdout.strip()).splitlines()
        raise CommandError(f"pytest {' '.join(argv)}: pytest refused the arguments (exit "
                           f"{done.returncode}): {' '.join(said[-3:])}")
    parsed = json.loads(line[len(MARK):])
    if parsed["problem"]:
        raise CommandError(f"pytest: {parsed['problem']}")
    for arg in parsed["args"]:
        if not (repo / arg.split("::")[0]).exists():
            raise CommandError(f"pytest: {arg}: no such test path")
    return list(parsed["args"])


def known_env_names(repo: Path) -> set[str]:
    """The environment variables the code reads by a named constant (``X_ENV = "NAME"``
    in src/torchgpu, benchmarks/gpu and tests/conftest.py), and :data:`STANDARD_ENV`.
    The files are parsed once per process and checkout (every step's check asks again;
    parsing them all takes ~1 s)."""
    return set(_env_names_in(Path(repo).resolve()))


@functools.cache
def _env_names_in(repo: Path) -> frozenset[str]:
    names = set(STANDARD_ENV)
    files = [*sorted((repo / "src" / "torchgpu").rglob("*.py")),
             *sorted((repo / "benchmarks" / "gpu").glob("*.py")), repo / "tests" / "conftest.py"]
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (OSError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)
                    and any(isinstance(t, ast.Name) and t.id.endswith("_ENV")
                            for t in node.targets)):
                names.add(node.value.value)
    return frozenset(names)


def check_env(repo: Path, env: Mapping[str, str]) -> None:
    """Every variable a step sets is one the code reads (a misspelt name does nothing)."""
    known = known_env_names(repo)
    for name in env:
        if name not in known:
            close = sorted(k for k in known if k.split("_")[:2] == name.split("_")[:2])
            raise CommandError(f"environment {name}={env[name]}: no code reads {name}"
                               + (f" (did you mean {', '.join(close)}?)" if close else ""))


def check_command(repo: Path, argv: Sequence[str], env: Mapping[str, str] | None = None
                  ) -> str:
    """Check one kit command (its argv, interpreter first, and the variables it sets);
    returns what was checked."""
    if len(argv) < 2:
        raise CommandError(f"{argv}: not a kit command")
    check_env(repo, env or {})
    rest = list(argv[1:])
    if rest[:2] == ["-m", "torchgpu"]:
        check_torchgpu(rest[2:], repo)
        return "torchgpu " + (rest[2] if len(rest) > 2 else "")
    if rest[:2] == ["-m", "pytest"]:
        check_pytest(repo, rest[2:])
        return "pytest"
    if rest[0].endswith(".py"):
        check_script(repo, rest[0], rest[1:])
        return rest[0]
    raise CommandError(f"{' '.join(argv)}: not a torchgpu, pytest or script command")
