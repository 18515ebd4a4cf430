"""``--compile``: the training model run through ``torch.compile``, with an eager fallback.

:func:`compile_for_run` compiles the module the run calls, after the strategy wrapped it
(under DDP dynamo then splits the graph at the gradient buckets, as torch recommends), *in
place* with ``nn.Module.compile``: parameter names, ``state_dict`` keys and checkpoints
stay the plain model's, so checkpoints move between eager and compiled runs. Where
compiling fails at the first forward (no C compiler, an unsupported platform, dynamo
raising), :class:`CompileGuard` prints one line naming why and runs that call, and the rest
of the run, eagerly: no step is lost or applied twice, and the random states are put back
so dropout draws the same. A call that fails eagerly too is the model's own error.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torchgpu.errors import ConfigError, UsageError

if TYPE_CHECKING:
    # torch only here and inside functions: the CLI's parser reads COMPILE_MODES, and
    # the config's checks validate(), without importing torch.
    from torch import nn

    from torchgpu.train.config import TrainConfig

#: ``--compile-mode`` values (``torch.compile``'s ``mode=``).
COMPILE_MODES: tuple[str, ...] = (
    "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def validate(config: TrainConfig) -> None:
    """ConfigError for an unknown ``--compile-mode``; UsageError for a mode without
    ``--compile``."""
    mode = config.compile_mode
    if mode is None:
        return
    if mode not in COMPILE_MODES:
        raise ConfigError(
            f"unknown compile_mode {mode!r}: allowed are {', '.join(COMPILE_MODES)} "
            "(torch.compile's modes). Pass one of them with --compile-mode, e.g. "
            "--compile --compile-mode max-autotune.")
    if not config.compile:
        raise UsageError(
            f"--compile-mode {mode} was given without --compile: add --compile (fit: "
            "compile=True) to compile the model, or drop --compile-mode.")


@dataclass
class CompileState:
    """What became of ``--compile``: ``mode``; ``compiled`` (False once it fell back to
    eager); ``fallback``: why it did (one line), else None."""

    mode: str
    compiled: bool = True
    fallback: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """The summary's ``compile`` entry."""
        return {"mode": self.mode, "compiled": self.compiled, "fallback": self.fallback}


def _is_compile_error(error: BaseException) -> bool:
    # dynamo's and inductor's own exceptions (BackendCompilerFailed, Unsupported,
    # InductorError...): a model's own errors are re-raised by dynamo as they are.
    module = type(error).__module__
    return module.startswith(("torch._dynamo", "torch._inductor"))


def _why(error: BaseException) -> str:
    """One line: the innermost cause (dynamo wraps the backend's error, e.g.
    BackendCompilerFailed around inductor's "no C++ compiler")."""
    root, seen = error, {id(error)}
    while True:
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if not isinstance(inner, BaseException) or id(inner) in seen:
            break
        root = inner
        seen.add(id(root))
    lines = [line.strip() for line in str(root).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(root).__name__}: {text}" if text else type(root).__name__


def _fallback_note(state: CompileState, where: str) -> str:
    return (f"note: --compile: torch.compile could not compile the model {where} "
            f"({state.fallback}); training continues eager (the same results, only without "
            "compile's speed-up). Install a C/C++ compiler for inductor, or drop --compile.")


class CompileGuard:
    """The compiled call of ``module`` with the eager fallback (the module's
    ``_compiled_call_impl``). Until one call has succeeded any failure of the compiled
    call that the eager call does not repeat falls back; after that only dynamo's and
    inductor's own errors (a recompilation failing) do."""

    def __init__(self, module: nn.Module, compiled: Any, state: CompileState) -> None:
        self.module, self.compiled, self.state = module, compiled, state
        self.succeeded = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        cpu = torch.get_rng_state() if not self.succeeded else None
        cuda = (torch.cuda.get_rng_state_all()
                if cpu is not None and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
                else None)
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as error:
            if isinstance(error, torch.OutOfMemoryError) or (
                    self.succeeded and not _is_compile_error(error)):
                raise
            if cpu is not None:
                torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
            self.module._compiled_call_impl = None  # the module's eager call from now on
            try:
                out = self.module._call_impl(*args, **kwargs)  # type: ignore[no-untyped-call]
            except BaseException:
                # the model's own error (it fails eagerly too): raised as without --compile
                self.module._compiled_call_impl = self
                raise
            self.state.compiled, self.state.fallback = False, _why(error)
            where = "at the first step" if not self.succeeded else "when it recompiled"
            print(_fallback_note(self.state, where), file=sys.stderr)
            return out
        self.succeeded = True
        return out


def compile_for_run(module: nn.Module, mode: str | None) -> tuple[nn.Module, str]:
    """``module`` compiled in place (``module.compile(mode=...)``) behind a
    :class:`CompileGuard`; returns it and a note for the console. The module keeps its
    class and keys; ``module._torchgpu_compile`` holds the :class:`CompileState`."""
    state = CompileState(mode or "default")
    module._torchgpu_compile = state  # type: ignore[assignment]
    try:
        module.compile(mode=state.mode)
    except Exception as error:  # torch.compile refused up front (platform, Python)
        state.compiled, state.fallback = False, _why(error)
        module._compiled_call_impl = None
        return module, _fallback_note(state, "on this platform")
    guard = CompileGuard(module, module._compiled_call_impl, state)
    module._compiled_call_impl = guard
    return module, (f"compile: torch.compile(mode={state.mode!r}), compiled at the first "
                    "step (this takes a while)")


def compile_summary(model: nn.Module) -> dict[str, Any] | None:
    """The summary's ``compile`` entry for the run's model (None when not compiled)."""
    state = getattr(model, "_torchgpu_compile", None)
    return state.as_dict() if isinstance(state, CompileState) else None
