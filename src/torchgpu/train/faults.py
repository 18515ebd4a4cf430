"""Test-only fault injection for ``torchgpu train``: crash one worker once, at a given step.

Used by the restart tests (a worker that dies mid-run is restarted by torchrun and
resumes from the last checkpoint). Three environment variables, read ONCE when the run
starts (:func:`crash_plan_from_env`), never in the training loop:

- ``TORCHGPU_FAULT_CRASH_AT_STEP=N``: kill this process with SIGKILL right after optimizer
  step ``N`` (after the checkpoint of step ``N``, if one is due), like a hard crash:
  nothing is flushed, no handler runs.
- ``TORCHGPU_FAULT_MARKER=PATH`` (required with the above): the crash happens only while
  ``PATH`` does not exist; the crashing process creates it just before dying, so the
  worker torchrun restarts does not crash again.
- ``TORCHGPU_FAULT_RANK=R``: the global rank that crashes (default 0).

Unset (the normal case), nothing is installed and the loop does no extra work.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torchgpu.errors import ConfigError

CRASH_STEP_ENV = "TORCHGPU_FAULT_CRASH_AT_STEP"
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
