"""Check a kit command against the code it will run, without running it.

- ``python3 -m torchgpu VERB ...``: the verb's own parser (whatever builds it: a
  ``_parser()`` or ``main``) parses the arguments; ``train`` is then validated as
  ``torchgpu train`` validates it (flag combinations, choices), and ``bench`` has its
  suite and size checked.
- ``python3 path/to/script.py ...``: the script exists, compiles, and its own argparse
  accepts the arguments.
- ``python3 -m pytest ...``: every path it names exists.

Each check raises :class:`CommandError` naming the command and what is wrong. Parsers are
stopped right after parsing (nothing is trained, benchmarked or printed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


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


def check_torchgpu(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` after ``python3 -m torchgpu``."""
    from torchgpu.cli.main import VERBS

    what = "torchgpu " + " ".join(argv)
    if not argv or argv[0] not in VERBS:
        raise CommandError(f"{what}: no such verb (the verbs are {', '.join(VERBS)})")
    module = importlib.import_module(VERBS[argv[0]][0])
    namespace = parse_with(module.main, argv[1:], what)
    try:
        if argv[0] == "train":
            from torchgpu.cli.train import config_from_argv
            from torchgpu.train.config import validate

            validate(config_from_argv(list(argv[1:])))
        elif argv[0] == "bench":
            from torchgpu.bench.runner import check_size, check_suite

            if namespace.suite != "all":
                check_size(check_suite(namespace.suite), namespace.size)
    except Exception as error:  # a TorchGpuError or argparse's exit: either way, refused
        raise CommandError(f"{what}: refused: {error}") from error
    return namespace


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
    return parse_with(module.main, argv, f"{path} {' '.join(argv)}")


def check_pytest(repo: Path, argv: Sequence[str]) -> None:
    """Every path-like argument of a pytest command exists."""
    value_flags = {"-m", "-k", "-p", "-n", "--timeout", "--dist", "--junitxml", "-c"}
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in value_flags:
            skip = True
            continue
        if arg.startswith("-"):
            continue
        if not (repo / arg.split("::")[0]).exists():
            raise CommandError(f"pytest: {arg}: no such test path")


def check_command(repo: Path, argv: Sequence[str]) -> str:
    """Check one kit command (its argv, interpreter first); returns what was checked."""
    if len(argv) < 2:
        raise CommandError(f"{argv}: not a kit command")
    rest = list(argv[1:])
    if rest[:2] == ["-m", "torchgpu"]:
        check_torchgpu(rest[2:])
        return "torchgpu " + (rest[2] if len(rest) > 2 else "")
    if rest[:2] == ["-m", "pytest"]:
        check_pytest(repo, rest[2:])
        return "pytest"
    if rest[0].endswith(".py"):
        check_script(repo, rest[0], rest[1:])
        return rest[0]
    raise CommandError(f"{' '.join(argv)}: not a torchgpu, pytest or script command")
