"""``--profile [N]``: N optimizer steps under ``torch.profiler``, after a short warm-up.

The run's first steps are slow for reasons that do not repeat (allocator growth, lazy
initialisation, cuDNN autotuning), so :func:`profile_window` skips up to
:data:`WARMUP_STEPS` of them, fewer when the run is too short to keep N after them.
:class:`StepProfiler` starts the profiler at an optimizer-step boundary (the loop's
``on_step`` hook) and stops it N boundaries later: the traced window is exactly N
whole steps, data loading included. Nothing is added to the loop when the flag is off.

Outputs (rank 0, under ``--out``): :data:`TRACE_FILE`, a Chrome trace that Perfetto
(ui.perfetto.dev) and chrome://tracing open; :data:`TABLE_FILE`, the top operators by
self time (also printed to stderr) and the share of the step spent in data loading,
forward, backward, optimizer and communication (:func:`step_shares`), which also go
into ``summary.json`` under ``profile``. Communication overlaps backward under DDP,
so the shares can add up to more than 100 %.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpu.train.config import DEFAULT_PROFILE_STEPS as DEFAULT_STEPS  # noqa: F401
from torchgpu.train.state import TrainState

WARMUP_STEPS = 3
TRACE_FILE = "profile.trace.json"
TABLE_FILE = "profile.txt"
FORWARD_LABEL = "torchgpu::forward"  # a user annotation around the model's forward
TOP_OPERATORS = 15

# Phase -> how its profiler events are named. Forward is our own annotation; the others
# are names PyTorch gives: the DataLoader's __next__, the autograd engine's functions,
# Optimizer.step/zero_grad (every torch.optim optimizer), and c10d/NCCL/Gloo collectives.
PHASES: dict[str, Callable[[str], bool]] = {
    "data": lambda name: name.startswith("enumerate(DataLoader)"),
    "forward": lambda name: name == FORWARD_LABEL,
    "backward": lambda name: name.startswith("autograd::engine::evaluate_function"),
    "optimizer": lambda name: name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")),
    "communication": lambda name: name.startswith(("c10d::", "nccl:", "gloo:",
                                                   "record_param_comms")),
}


@dataclass(frozen=True)
class ProfileWindow:
    """Trace optimizer steps ``start + warmup + 1 .. start + warmup + steps``."""

    warmup: int
    steps: int


def profile_window(requested: int, remaining_steps: int) -> ProfileWindow:
    """The window for ``--profile requested`` in a run with ``remaining_steps`` to go:
    warm-up of up to :data:`WARMUP_STEPS` steps, shortened so the ``requested`` steps
    still fit; the steps themselves capped at what the run has."""
    warmup = max(0, min(WARMUP_STEPS, remaining_steps - requested))
    return ProfileWindow(warmup, max(0, min(requested, remaining_steps - warmup)))


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """The length covered by ``intervals`` ((start, end) pairs), overlaps counted once."""
    total = 0.0
    end_so_far = -float("inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def step_shares(events: Sequence[tuple[str, float, float]], window_us: float
                ) -> dict[str, float]:
    """The fraction of ``window_us`` each phase of :data:`PHASES` covers, from events
    ``(name, start_us, end_us)``; nested events of one phase count once."""
    shares: dict[str, float] = {}
    for phase, matches in PHASES.items():
        covered = union_us((s, e) for name, s, e in events if matches(name))
        shares[phase] = covered / window_us if window_us > 0 else 0.0
    return shares


class _ForwardMarks:
    """Forward pre-/post-hooks on the model that open and close a profiler annotation,
    so the trace and :func:`step_shares` see the forward as one span."""

    def __init__(self, model: nn.Module) -> None:
        self._open: list[Any] = []
        self._handles = [model.register_forward_pre_hook(self._enter),
                         model.register_forward_hook(self._exit)]

    def _enter(self, module: nn.Module, args: Any) -> None:
        mark: Any = torch.profiler.record_function(FORWARD_LABEL)
        mark.__enter__()
        self._open.append(mark)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._open:
            self._open.pop().__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        while self._open:  # a forward that raised (out of memory) left its mark open
            self._open.pop().__exit__(None, None, None)


class StepProfiler:
    """Profiles one window of optimizer steps of a run (see the module docstring).

    Use: ``on_step = profiler.wrap(on_step)`` before the loop, ``profiler.begin(state)``
    once the state is known, ``profiler.close()`` after the loop (it finishes a window
    the run ended inside). ``result`` holds the summary entry once finished.
    """

    def __init__(self, model: nn.Module, device: torch.device, out_dir: Path,
                 window: ProfileWindow) -> None:
        self.model = model
        self.device = device
        self.out_dir = out_dir
        self.window = window
        self.start_step: int | None = None  # the step after which tracing starts
        self.result: dict[str, Any] | None = None
        self._profiler: Any = None
        self._marks: _ForwardMarks | None = None
        self._started_at = 0.0
        self._first_step = 0

    def begin(self, state: TrainState) -> None:
        """The run (or its resumed part) starts at ``state.step``."""
        self.start_step = state.step + self.window.warmup
        if self.window.warmup == 0:
            self._start(state)

    def wrap(self, inner: Callable[[TrainState], None] | None
             ) -> Callable[[TrainState], None]:
        """``inner`` (the loop's other ``on_step`` hook, or None) followed by this one."""
        def on_step(state: TrainState) -> None:
            if inner is not None:
                inner(state)
            self.step(state)
        return on_step

    def step(self, state: TrainState) -> None:
        """After an optimizer step: start or stop the window at its boundaries."""
        if self.start_step is None or self.result is not None:
            return
        if self._profiler is None:
            if state.step >= self.start_step:
                self._start(state)
        elif state.step - self._first_step >= self.window.steps:
            self._finish(state.step - self._first_step)

    def close(self, state: TrainState) -> None:
        """End of the run: finish a window still open (the run had fewer steps)."""
        if self._profiler is not None and self.result is None:
            self._finish(state.step - self._first_step)

    def _start(self, state: TrainState) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._marks = _ForwardMarks(self.model)
        self._profiler = profile(activities=activities, record_shapes=False)
        self._profiler.__enter__()
        self._first_step = state.step
        self._started_at = time.perf_counter()

    def _finish(self, steps: int) -> None:
        if self.device.type == "cuda":  # the kernels of the last step belong to the window
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self._started_at
        prof, self._profiler = self._profiler, None
        prof.__exit__(None, None, None)
        if self._marks is not None:
            self._marks.remove()
        trace = self.out_dir / TRACE_FILE
        prof.export_chrome_trace(str(trace))
        events = [(e.name, float(e.time_range.start), float(e.time_range.end))
                  for e in prof.events()]
        shares = step_shares(events, seconds * 1e6)
        on_gpu = self.device.type == "cuda"
        sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        averages = prof.key_averages()
        table = averages.table(sort_by=sort_by, row_limit=TOP_OPERATORS)
        top = sorted(averages, key=lambda a: -float(getattr(a, sort_by, 0.0)))[:TOP_OPERATORS]
        step_s = seconds / steps if steps else None
        text = format_report(table, shares, steps, step_s, trace)
        (self.out_dir / TABLE_FILE).write_text(text, encoding="utf-8")
        print(text, file=sys.stderr)
        self.result = {
            "trace": str(trace),
            "table": str(self.out_dir / TABLE_FILE),
            "warmup_steps": self.window.warmup,
            "steps": steps,
            "step_seconds": step_s,
            "shares": shares,
            "top_operators": [{"name": a.key, "calls": int(a.count),
                               "self_us": float(getattr(a, sort_by, 0.0))} for a in top],
        }


def format_report(table: str, shares: dict[str, float], steps: int, step_seconds: float | None,
                  trace: Path) -> str:
    """The profile as a person reads it: where the step's time went, then the table."""
    per_step = f"{step_seconds * 1e3:.2f} ms/step" if step_seconds is not None else "no steps"
    parts = ", ".join(f"{name} {share:.0%}" for name, share in shares.items())
    other = max(0.0, 1.0 - sum(v for k, v in shares.items() if k != "communication"))
    return (f"profile: {steps} step(s), {per_step}; share of step time: {parts}, "
            f"other {other:.0%}\ntrace (Perfetto / chrome://tracing): {trace}\n"
            f"top operators by self time:\n{table}")
