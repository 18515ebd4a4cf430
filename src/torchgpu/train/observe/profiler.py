"""``--profile [N]``: N optimizer steps under ``torch.profiler``, after a short warm-up.

The first steps are slow for reasons that do not repeat (allocator growth, lazy
initialisation, cuDNN autotuning), so up to :data:`WARMUP_STEPS` are skipped (fewer when
the run is short). :class:`StepProfiler` traces exactly N whole steps, boundary to
boundary, data loading included; without the flag nothing is added to the loop. Rank 0
writes ``TRACE_FILE`` (a Chrome trace, for Perfetto) and ``TABLE_FILE`` (the top
operators by self time and the step's shares, ``step_shares``: each moment counted
once, so they add up to 100 %), also printed and in ``summary.json``. A run shorter than
asked is profiled whole, and says so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpu.checkpoint.atomic import write_error, write_file_atomic
from torchgpu.train.config import DEFAULT_PROFILE_STEPS as DEFAULT_STEPS  # noqa: F401
from torchgpu.train.outputs import files as outputs
from torchgpu.train.state import TrainState

WARMUP_STEPS = 3
TRACE_FILE = outputs.PROFILE_TRACE_FILE
TABLE_FILE = outputs.PROFILE_TABLE_FILE
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
    """Trace optimizer steps ``start + warmup + 1 .. start + warmup + steps``
    (``requested``: the steps ``--profile`` asked for)."""

    warmup: int
    steps: int
    requested: int

    def note(self) -> str | None:
        """What the user is told when the run has fewer steps than ``--profile`` asked for."""
        if self.steps >= self.requested:
            return None
        return (f"note: --profile {self.requested} asks for more steps than the run has "
                f"left ({self.steps}): profiling all {self.steps}, without warm-up; pass "
                f"--profile {max(1, self.steps - WARMUP_STEPS)} or more --epochs to profile "
                "steps after a warm-up.")


def profile_window(requested: int, remaining_steps: int) -> ProfileWindow:
    """The window for ``--profile requested`` in a run with ``remaining_steps`` to go:
    warm-up of up to :data:`WARMUP_STEPS` steps, shortened so the ``requested`` steps
    still fit; the steps themselves capped at what the run has."""
    warmup = max(0, min(WARMUP_STEPS, remaining_steps - requested))
    return ProfileWindow(warmup, max(0, min(requested, remaining_steps - warmup)), requested)


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


Event = tuple[str, float, float] | tuple[str, float, float, int]  # name, start, end[, thread]


def step_shares(events: Sequence[Event], window_us: float) -> dict[str, float]:
    """The share of ``window_us`` spent in each phase of :data:`PHASES`, and ``other``:
    every moment counts once, so the shares add up to 1.

    Events are ``(name, start_us, end_us[, thread])``. The main thread (the one with the
    forward marks) says what the step is doing: at each moment its innermost phase event
    (a collective called inside backward is communication). Between its phase events:
    from the end of a forward to the next backward is the loss (counted as forward);
    between two events of one phase, that phase (the autograd engine between nodes);
    elsewhere communication where another thread's collective runs then (the main thread
    waits for it, e.g. DDP's last all-reduce before the optimizer step), else ``other``.
    Communication that overlaps compute is hidden behind it and not counted."""
    phased = [(phase, float(e[1]), float(e[2]), int(e[3]) if len(e) > 3 else 0)
              for e in events for phase, matches in PHASES.items() if matches(e[0])]
    threads = [t for phase, _, _, t in phased if phase == "forward"] or \
        [t for *_, t in phased]
    main = max(set(threads), key=threads.count) if threads else 0
    segments = _innermost([(s, e, phase) for phase, s, e, t in phased if t == main])
    others = sorted((s, e) for phase, s, e, t in phased
                    if t != main and phase == "communication")
    totals = dict.fromkeys(PHASES, 0.0)
    for i, (start, end, phase) in enumerate(segments):
        if phase is None:
            before = next((p for *_, p in reversed(segments[:i]) if p is not None), None)
            after = next((p for *_, p in segments[i + 1:] if p is not None), None)
            if (before, after) == ("forward", "backward") or (before == after and before):
                phase = before
            else:
                waited = _overlap(start, end, others)
                totals["communication"] += waited
                end -= waited  # the rest stays "other"
        if phase is not None:
            totals[phase] += end - start
    shares = {k: v / window_us if window_us > 0 else 0.0 for k, v in totals.items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def _innermost(intervals: list[tuple[float, float, str]]
               ) -> list[tuple[float, float, str | None]]:
    """One thread's events cut into consecutive segments, each labelled with the
    innermost event covering it (None: none does), from the first start to the last end.
    An event that outlasts the one it starts in is cut at its end (one thread's spans
    nest)."""
    segments: list[tuple[float, float, str | None]] = []
    stack: list[tuple[float, str]] = []  # (end, label), innermost last
    cursor: float | None = None

    def advance(to: float) -> None:
        nonlocal cursor
        while stack and stack[-1][0] <= to:
            end, label = stack.pop()
            if cursor is not None and end > cursor:
                segments.append((cursor, end, label))
            cursor = end if cursor is None or end > cursor else cursor
        if cursor is not None and to > cursor:
            segments.append((cursor, to, stack[-1][1] if stack else None))
        cursor = to if cursor is None or to > cursor else cursor

    for start, end, label in sorted(intervals, key=lambda x: (x[0], -x[1])):
        advance(start)
        stack.append((min(end, stack[-1][0]) if stack else end, label))
    advance(float("inf") if not stack else max(e for e, _ in stack))
    return segments


def _overlap(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """How much of [start, end) the ``intervals`` (sorted by start) cover, once."""
    return union_us((max(s, start), min(e, end)) for s, e in intervals
                    if s < end and e > start)


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
        note = self.window.note()
        if note is not None:
            print(note, file=sys.stderr)
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
        export_trace(prof, trace)
        cpu = torch.profiler.DeviceType.CPU  # the host's events (kernels have their own)
        events: list[Event] = [
            (e.name, float(e.time_range.start), float(e.time_range.end), int(e.thread))
            for e in prof.events() if getattr(e, "device_type", cpu) == cpu]
        shares = step_shares(events, seconds * 1e6)
        on_gpu = self.device.type == "cuda"
        sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        averages = prof.key_averages()
        table = averages.table(sort_by=sort_by, row_limit=TOP_OPERATORS)
        top = sorted(averages, key=lambda a: -float(getattr(a, sort_by, 0.0)))[:TOP_OPERATORS]
        step_s = seconds / steps if steps else None
        text = format_report(table, shares, steps, step_s, trace)
        write_file_atomic(self.out_dir / TABLE_FILE, text.encode("utf-8"))
        print(text, file=sys.stderr)
        self.result = {
            "trace": str(trace),
            "table": str(self.out_dir / TABLE_FILE),
            "warmup_steps": self.window.warmup,
            "requested_steps": self.window.requested,
            "steps": steps,
            "step_seconds": step_s,
            "shares": shares,
            "top_operators": [{"name": a.key, "calls": int(a.count),
                               "self_us": float(getattr(a, sort_by, 0.0))} for a in top],
        }


def export_trace(prof: Any, trace: Path) -> None:
    """``prof``'s Chrome trace written to ``trace`` atomically, or a one-paragraph
    :class:`~torchgpu.errors.CheckpointWriteError`. Kineto writes its own temporary file
    and only logs a failed rename, so the trace goes to a temporary name first and is
    checked before it takes its place."""
    temporary = trace.with_name(f".{trace.name}.tmp-{os.getpid()}")
    try:
        prof.export_chrome_trace(str(temporary))
        if not temporary.is_file():
            raise OSError(errno.EIO, "torch's profiler wrote no trace file", str(temporary))
        os.replace(temporary, trace)
    except OSError as error:  # something in the way, a full disk
        for leftover in (temporary, temporary.with_name(temporary.name + ".tmp")):
            with contextlib.suppress(OSError):
                leftover.unlink()
        raise write_error(trace, error) from None


def format_report(table: str, shares: dict[str, float], steps: int, step_seconds: float | None,
                  trace: Path) -> str:
    """The profile as a person reads it: where the step's time went, then the table."""
    per_step = f"{step_seconds * 1e3:.2f} ms/step" if step_seconds is not None else "no steps"
    parts = ", ".join(f"{name} {share:.0%}" for name, share in shares.items())
    return (f"profile: {steps} step(s), {per_step}; share of step time (each moment once; "
            f"forward includes the loss): {parts}\ntrace (Perfetto / chrome://tracing): "
            f"{trace}\ntop operators by self time:\n{table}")
