"""Test-only fault injection for ``torchgpu train``: crash or hang one worker at a step.

A plug-in of the run's hooks; the variables are read once at assembly
(:func:`hooks_from_env`), never in the loop, and unset the module is not even imported.

- ``TORCHGPU_FAULT_CRASH_AT_STEP=N``: SIGKILL this process right after optimizer step ``N``
  (and its due checkpoint), like a hard crash: nothing is flushed, no handler runs.
- ``TORCHGPU_FAULT_MARKER=PATH`` (required with it): crash only while ``PATH`` does not
  exist; the crash creates it first, so the worker torchrun restarts does not crash again.
- ``TORCHGPU_FAULT_HANG_AT_STEP=N``: block for good before step ``N``'s gradient all-reduce
  (the stage pipeline: before its schedule); the peers wait until ``--collective-timeout``.
- ``TORCHGPU_FAULT_RANK=R``: the global rank that crashes or hangs (default 0).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchgpu.errors import ConfigError
from torchgpu.train.hooks.run_hooks import LossFn, RunHook

if TYPE_CHECKING:
    from torchgpu.launch.stop_record import StopFlag
    from torchgpu.train.state import TrainState

CRASH_STEP_ENV = "TORCHGPU_FAULT_CRASH_AT_STEP"
HANG_STEP_ENV = "TORCHGPU_FAULT_HANG_AT_STEP"
MARKER_ENV = "TORCHGPU_FAULT_MARKER"
RANK_ENV = "TORCHGPU_FAULT_RANK"


@dataclass(frozen=True)
class CrashPlan:
    """Crash this process after optimizer step ``step``, unless ``marker`` exists."""

    step: int
    marker: Path

    def maybe_crash(self, step: int) -> None:
        """SIGKILL this process if ``step`` is the planned one (the marker is created first)."""
        if step != self.step or self.marker.exists():
            return
        self.marker.parent.mkdir(parents=True, exist_ok=True)
        self.marker.write_text(f"crashed at step {step} (pid {os.getpid()})\n")
        os.kill(os.getpid(), signal.SIGKILL)


def _int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not an integer: it must be a whole number "
            f"(e.g. {name}=3), or unset it."
        ) from None


def crash_plan_from_env(rank: int, environ: Mapping[str, str] | None = None) -> CrashPlan | None:
    """The crash this process must perform, or ``None`` (the variables unset, another
    rank chosen, or the marker already there). Raises ConfigError for bad values."""
    env = os.environ if environ is None else environ
    step = _int(env, CRASH_STEP_ENV, None)
    if step is None:
        return None
    marker = env.get(MARKER_ENV, "").strip()
    if not marker:
        raise ConfigError(
            f"{CRASH_STEP_ENV}={step} needs {MARKER_ENV}=PATH, a file that records the crash "
            "so a restarted worker does not crash again: set it to a path that does not exist."
        )
    if step < 1:
        raise ConfigError(f"{CRASH_STEP_ENV}={step} is out of range: use a step of 1 or more.")
    if _int(env, RANK_ENV, 0) != rank or Path(marker).exists():
        return None
    return CrashPlan(step, Path(marker))


@dataclass(frozen=True)
class HangPlan:
    """Block for good before optimizer step ``step``'s gradient all-reduce."""

    step: int

    def wrap(self, loss_fn: Callable[[Any, Any], Any], steps_done: Callable[[], int],
             before: str = "gradient all-reduce") -> Callable[[Any, Any], Any]:
        """``loss_fn``, blocking forever when called during step ``step`` (``steps_done()``
        is the number of optimizer steps finished). ``before``: what of the step it blocks
        before, for its message (the stage pipeline: its stages' sends and receives)."""
        def loss(out: Any, target: Any) -> Any:
            if steps_done() + 1 == self.step:
                print(f"fault injection: hanging before step {self.step}'s {before} "
                      f"(pid {os.getpid()})", flush=True)
                while True:  # a real hang: signals set flags, nothing ends it but a kill
                    time.sleep(1.0)
            return loss_fn(out, target)
        return loss


def hang_plan_from_env(rank: int, environ: Mapping[str, str] | None = None) -> HangPlan | None:
    """The hang this process must perform, or ``None``. Raises ConfigError for bad values."""
    env = os.environ if environ is None else environ
    step = _int(env, HANG_STEP_ENV, None)
    if step is None:
        return None
    if step < 1:
        raise ConfigError(f"{HANG_STEP_ENV}={step} is out of range: use a step of 1 or more.")
    if _int(env, RANK_ENV, 0) != rank:
        return None
    return HangPlan(step)


@dataclass(frozen=True)
class FaultHook(RunHook):
    """The run hook that performs this process's planted crash and/or hang."""

    crash: CrashPlan | None = None
    hang: HangPlan | None = None

    def wrap_loss(self, loss_fn: LossFn, steps_done: Callable[[], int],
                  before: str) -> LossFn:
        if self.hang is None:
            return loss_fn
        return self.hang.wrap(loss_fn, steps_done, before)

    def after_step(self, state: TrainState, stop: StopFlag) -> None:
        if self.crash is not None:
            self.crash.maybe_crash(state.step)


def hooks_from_env(rank: int, environ: Mapping[str, str] | None = None) -> list[RunHook]:
    """The run hooks for ``rank`` that the variables plant (none: an empty list); the
    plug-in function of :data:`torchgpu.train.hooks.run_hooks.ENV_PLUGINS`. Raises ConfigError
    for bad values."""
    crash, hang = crash_plan_from_env(rank, environ), hang_plan_from_env(rank, environ)
    return [FaultHook(crash, hang)] if crash is not None or hang is not None else []
