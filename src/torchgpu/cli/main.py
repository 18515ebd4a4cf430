"""``torchgpu VERB ...``: dispatch to one module per verb.

Verb modules are imported only when named, so ``torchgpu devices`` never pays for
the training engine's imports. Every verb module exposes ``main(argv) -> int``; it is
imported and run inside :func:`~torchgpu.cli.common.run_guarded`, with the stop signals
handled from the entry point's first line (:mod:`torchgpu.cli.signals`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from torchgpu.cli import signals

VERBS: dict[str, tuple[str, str]] = {
    "devices": ("torchgpu.cli.devices", "what GPUs, MPS and CPU this machine has"),
    "select": ("torchgpu.cli.select", "pick GPUs for CUDA_VISIBLE_DEVICES"),
    "env": ("torchgpu.cli.env", "versions and variables for a bug report"),
    "doctor": ("torchgpu.cli.doctor", "find environment pitfalls (and device mismatches)"),
    "train": ("torchgpu.cli.train", "train a built-in example or your CSV on any devices"),
    "launch": ("torchgpu.cli.launch", "torchrun for your own script, free port by default"),
    "bench": ("torchgpu.cli.bench", "measure this machine: matmul, transfer, parallel, ..."),
    "ckpt": ("torchgpu.cli.ckpt", "inspect, convert and verify checkpoints"),
    "plan": ("torchgpu.cli.plan", "memory per strategy and the plan that fits"),
}


def _usage() -> str:
    width = max(len(v) for v in VERBS)
    lines = ["usage: torchgpu VERB [ARGS...]", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {summary}" for verb, (_, summary) in VERBS.items()]
    lines += ["", "`torchgpu VERB --help` shows a verb's flags."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``torchgpu`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        print(_usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from torchgpu import __version__

        print(f"torchgpu {__version__}")
        return 0
    verb = args[0]
    if verb not in VERBS:
        print(
            f"torchgpu: unknown verb {verb!r}. Allowed: {', '.join(VERBS)}. "
            "Run `torchgpu --help` for what each does.",
            file=sys.stderr,
        )
        return 2
    from torchgpu.cli.common import run_guarded

    result: int = run_guarded(_imported(VERBS[verb][0]), args[1:])
    return result


def _imported(module_name: str) -> Callable[[list[str]], int]:
    """The verb's ``main``, its module imported when called (inside the guard)."""
    def verb_main(argv: list[str]) -> int:
        module = importlib.import_module(module_name)
        signals.started()
        code: int = module.main(argv)
        signals.settle()  # done: a signal from now on changes nothing
        return code
    return verb_main


def entry() -> None:
    """Console-script entry point (``python -m torchgpu`` too)."""
    signals.install()
    code = main()
    signals.settle()
    exit_process(code)


def exit_process(code: int) -> NoReturn:
    """End this process with ``code``, without the interpreter's teardown once torch is
    loaded: freeing every module (torch's, dynamo's and sympy's objects one by one) took
    0.3 s quiet and over a second under load here, more than the rest of a short run's
    cost over a plain script. Everything a verb writes is written and closed by then;
    stdout and stderr are flushed and the atexit handlers run (a plug-in's too), then
    ``os._exit``. A process with a non-daemon thread or a child process still running
    exits the normal way (that exit waits for the thread, or reaps the child)."""
    if "torch" not in sys.modules or _still_running():
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed or broken stream: the normal exit copes
        sys.exit(code)
    atexit._run_exitfuncs()  # what the interpreter's exit would run first
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _still_running() -> bool:
    """A non-daemon thread besides this one, or a child process, still exists."""
    import threading

    from torchgpu.launch.stop import child_pids

    main_thread = threading.main_thread()
    return (any(t is not main_thread and not t.daemon and t.is_alive()
                for t in threading.enumerate()) or bool(child_pids()))
