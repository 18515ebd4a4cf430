"""What every CLI verb shares: an argparse that exits 2 with one paragraph, and a guard
that turns torchgpu's errors into exit codes instead of tracebacks."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from torchgpu.errors import EXIT_USAGE, TorchGpuError, UsageError, exit_code_for


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one paragraph on stderr and exits 2, and hands
    a flag a value that starts like a negative number (``--input-shape -1,4``,
    ``--min-free -1GiB``) so that the flag's own check says what is wrong with it."""

    def parse_known_args(  # type: ignore[override]  # typeshed overloads on namespace
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        flags = [flag for action in self._actions if action.nargs is None
                 for flag in action.option_strings]
        remainder = any(action.nargs == argparse.REMAINDER for action in self._actions)
        argv = sys.argv[1:] if args is None else args
        return super().parse_known_args(attach_values(argv, flags, remainder), namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(
            EXIT_USAGE,
            f"{self.prog}: {message}. Run `{self.prog} --help` for the accepted flags.\n",
        )


def attach_values(argv: Sequence[str], flags: Sequence[str],
                  until_positional: bool = False) -> list[str]:
    """``argv`` with ``FLAG VALUE`` written ``FLAG=VALUE`` for each of ``flags`` whose
    value starts with ``-`` (``--min-free -1GiB``): argparse would take such a value for
    an option and answer "expected one argument"; attached, it reaches the flag's own
    check, which can say what is wrong with it. ``until_positional``: the first
    positional argument and all after it are left as they are (``launch SCRIPT ARGS``:
    the script's own arguments are not this parser's)."""
    out: list[str] = []
    items = list(argv)
    i = 0
    while i < len(items):
        item = items[i]
        if item == "--" or (until_positional and not item.startswith("-")):
            out += items[i:]
            break
        if item in flags and i + 1 < len(items):
            value = items[i + 1]
            if value.startswith("-") and (value[1:2].isdigit() or value[1:2] == "."):
                out.append(f"{item}={value}")
            else:
                out += [item, value]
            i += 2
            continue
        out.append(item)
        i += 1
    return out


def parse_int(flag: str, text: str, low: int, high: int, what: str = "") -> int:
    """``text`` as an integer in ``low..high``, else :class:`UsageError` naming ``flag``
    (when not empty), the value, the range and (``what``) why the range is what it is.
    The one range check behind the CLI's integer values: a huge number must be refused
    here, not overflow in torch or the OS later (a traceback)."""
    raw = text.strip()
    named = f"{flag} " if flag else ""
    try:
        value = int(raw, 10)
    except ValueError:
        raise UsageError(f"{named}{text!r} is not a whole number: pass one in "
                         f"{low}..{high}{what}.") from None
    if not low <= value <= high:
        shown = raw if len(raw) <= 24 else f"{raw[:10]}...{raw[-6:]} ({len(raw)} digits)"
        raise UsageError(f"{named}{shown} is out of range: it must be in "
                         f"{low}..{high}{what}.")
    return value


def int_in(flag: str, low: int, high: int, what: str = "") -> Callable[[str], int]:
    """An argparse ``type=`` for an integer flag in ``low..high`` (:func:`parse_int`);
    a bad value is argparse's one-paragraph error, exit 2."""
    def convert(text: str) -> int:
        try:  # argparse names the flag itself ("argument --threads: ...")
            return parse_int("", text, low, high, what)
        except UsageError as error:
            raise argparse.ArgumentTypeError(str(error).rstrip(".")) from None
    convert.__name__ = flag  # argparse names the type in some messages
    return convert


def fail(message: str, code: int = EXIT_USAGE) -> int:
    """Print ``message`` to stderr as ``torchgpu: ...`` and return ``code``."""
    print(f"torchgpu: {message}", file=sys.stderr)
    return code


def run_guarded(verb_main: Callable[[list[str]], int], argv: Sequence[str]) -> int:
    """Call ``verb_main(argv)``; a :class:`TorchGpuError` becomes its message and exit code.

    A stop signal (:mod:`torchgpu.cli.signals`) becomes one line and 128 + its number,
    also when what it interrupted failed in another way on the way out (an import cut
    short leaves a library half-initialised). Other exceptions are real bugs or runtime
    failures and keep their traceback. ``SystemExit`` from argparse passes through with
    its code.
    """
    from torchgpu.cli import signals

    try:
        return verb_main(list(argv))
    except TorchGpuError as error:
        return fail(str(error), exit_code_for(error))
    except signals.Stopped as stopped:
        return fail(f"stopped by {stopped}", 128 + stopped.signum)  # str: its name
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except BrokenPipeError:
        # `torchgpu devices --json | head`: the reader left; not an error of ours.
        # Point stdout at devnull so the interpreter's final flush stays quiet.
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except Exception:
        sig = signals.received()
        if sig is None:
            raise
        return fail(f"stopped by {sig.name}", 128 + int(sig))
