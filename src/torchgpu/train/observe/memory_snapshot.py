"""CUDA memory, explained: allocator snapshots on request (``--memory-snapshot``) and on OOM.

``--memory-snapshot`` records the caching allocator's history over the training loop (each
allocation's Python stack, ~2 us per allocation, so only when asked; C++ frames would take
minutes to symbolise) and at the end writes :data:`SNAPSHOT` ``.pickle`` and ``.html``
(PyTorch's renderer). On a CUDA OOM an observer the allocator calls before it raises (so
before the back-off frees anything) writes :data:`OOM_SNAPSHOT` ``.pickle``/``.html`` and
prints one message naming both and the biggest live allocations, grouped by module, the
optimizer or the code that made them (by size only without the flag's stacks). The HTML's
timeline loads MemoryViz.js from cdn.jsdelivr.net; https://pytorch.org/memory_viz opens the
``.pickle`` offline. On CPU the flag is refused (no caching allocator).
"""

from __future__ import annotations

import html
import inspect
import pickle
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchgpu.checkpoint.atomic import write_file_atomic
from torchgpu.errors import ConfigError

SNAPSHOT = "memory_snapshot"
OOM_SNAPSHOT = "oom_snapshot"
MAX_ENTRIES = 200_000  # alloc/free events kept (a ring buffer; several KB each)
# Python frames only: what site_label reads (module forwards, the optimizer, backward).
# C++ frames ("all", torch's default) cost a symbolisation pass at _snapshot() that took
# minutes on real runs (pytorch/torchtitan#3628: 461 s vs 4 s). The `stacks` argument is
# there in torch 2.11 and 2.13 alike (and since 2.1; this project needs 2.10+).
STACKS = "python"
TOP = 5


def refuse_off_cuda(requested: bool, device: torch.device) -> None:
    """``--memory-snapshot`` on a device other than CUDA: ConfigError with the reason."""
    if requested and device.type != "cuda":
        raise ConfigError(
            f"--memory-snapshot records the CUDA caching allocator's history, but this run "
            f"trains on {device}, which has no such allocator (CPU memory is the process's, "
            "shown as peak_memory_bytes in summary.json). Drop --memory-snapshot, or train "
            "on a GPU with --device cuda."
        )


def file_names(stem: str, rank: int) -> tuple[str, str]:
    """The pickle and HTML file names of a snapshot (rank 0 plain, others suffixed)."""
    base = stem if rank == 0 else f"{stem}.rank{rank}"
    return f"{base}.pickle", f"{base}.html"


@dataclass(frozen=True)
class Site:
    """Live bytes allocated at one place (a module's forward, the optimizer, code)."""

    label: str
    bytes: int
    blocks: int


def module_forwards(model: nn.Module) -> dict[str, list[tuple[int, int, str]]]:
    """Source file -> ``(first_line, last_line, "Class.forward")`` for the forward of
    every module class in ``model``, to name the module a stack frame runs in."""
    sites: dict[str, list[tuple[int, int, str]]] = {}
    for cls in {type(m) for m in model.modules()}:
        forward = getattr(cls, "forward", None)
        try:
            filename = inspect.getsourcefile(forward)  # type: ignore[arg-type]
            lines, first = inspect.getsourcelines(forward)  # type: ignore[arg-type]
        except (TypeError, OSError):
            continue
        if filename:
            sites.setdefault(filename, []).append(
                (first, first + len(lines) - 1, f"{cls.__name__}.forward"))
    return sites


def site_label(frames: Sequence[Mapping[str, Any]],
               forwards: Mapping[str, list[tuple[int, int, str]]]) -> str:
    """Who allocated a block, from its stack (innermost frame first): the innermost
    module forward of ``forwards``, else the optimizer, backward, or the innermost frame
    outside PyTorch; "unknown" without a stack."""
    for frame in frames:
        for first, last, name in forwards.get(str(frame.get("filename", "")), ()):
            if first <= int(frame.get("line", 0)) <= last:
                return name
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if "/torch/optim/" in filename:
            return "optimizer state"
        if filename.endswith(("torch/_tensor.py", "torch/autograd/__init__.py")) and (
                frame.get("name") in ("backward", "_engine_run_backward")):
            return "backward (gradients, temporaries)"
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if filename and "/torch/" not in filename and not filename.startswith("<"):
            return f"{frame.get('name')} ({Path(filename).name}:{frame.get('line')})"
    return "unknown (no stack recorded)" if not frames else "PyTorch internals"


def biggest_live(snapshot: Mapping[str, Any],
                 forwards: Mapping[str, list[tuple[int, int, str]]] | None = None,
                 top: int = TOP) -> list[Site]:
    """The ``top`` sites holding the most live (allocated) bytes in ``snapshot``
    (``torch.cuda.memory._snapshot()``'s format), biggest first."""
    totals: dict[str, list[int]] = {}
    for segment in snapshot.get("segments", ()):
        for block in segment.get("blocks", ()):
            if block.get("state") != "active_allocated":
                continue
            label = site_label(block.get("frames") or (), forwards or {})
            entry = totals.setdefault(label, [0, 0])
            entry[0] += int(block.get("requested_size") or block.get("size", 0))
            entry[1] += 1
    sites = [Site(label, size, count) for label, (size, count) in totals.items()]
    return sorted(sites, key=lambda s: -s.bytes)[:top]


def live_bytes(snapshot: Mapping[str, Any]) -> tuple[int, int]:
    """(allocated, reserved) bytes in ``snapshot``."""
    allocated = reserved = 0
    for segment in snapshot.get("segments", ()):
        reserved += int(segment.get("total_size", 0))
        allocated += sum(int(b.get("size", 0)) for b in segment.get("blocks", ())
                         if b.get("state") == "active_allocated")
    return allocated, reserved


def render_html(snapshot: Mapping[str, Any], title: str, sites: Sequence[Site]) -> str:
    """PyTorch's memory timeline page for ``snapshot`` with a static summary on top."""
    from torch.cuda._memory_viz import trace_plot

    from torchgpu.sizes import format_bytes

    page = str(trace_plot(dict(snapshot)))  # type: ignore[no-untyped-call]
    allocated, reserved = live_bytes(snapshot)
    rows = "".join(f"<tr><td>{html.escape(s.label)}</td><td>{format_bytes(s.bytes)}</td>"
                   f"<td>{s.blocks}</td></tr>" for s in sites)
    summary = (
        f"<h2>{html.escape(title)}</h2><p>live {format_bytes(allocated)} allocated, "
        f"{format_bytes(reserved)} reserved by the caching allocator.</p>"
        "<table border=1 cellpadding=4><tr><th>allocated by</th><th>live</th><th>blocks"
        f"</th></tr>{rows}</table><p>The interactive timeline below loads PyTorch's "
        "MemoryViz.js from cdn.jsdelivr.net; offline, open the .pickle next to this file "
        "at https://pytorch.org/memory_viz.</p>")
    return page.replace("<body>", "<body>\n" + summary, 1)


def _format_sites(sites: Sequence[Site]) -> str:
    from torchgpu.sizes import format_bytes

    return "; ".join(f"{s.label} {format_bytes(s.bytes)} ({s.blocks} blocks)" for s in sites)


def write_snapshot(snapshot: Mapping[str, Any], out_dir: Path, stem: str, rank: int,
                   title: str, forwards: Mapping[str, list[tuple[int, int, str]]]
                   ) -> tuple[Path, Path, list[Site]]:
    """Write ``snapshot`` as pickle and HTML under ``out_dir``; return both paths and
    the biggest live sites."""
    pickle_name, html_name = file_names(stem, rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    pickle_path, html_path = out_dir / pickle_name, out_dir / html_name
    write_file_atomic(pickle_path, pickle.dumps(dict(snapshot)))
    sites = biggest_live(snapshot, forwards)
    write_file_atomic(html_path, render_html(snapshot, title, sites).encode("utf-8"))
    return pickle_path, html_path, sites


@dataclass
class MemoryRecorder:
    """A run's allocator history (``record``: ``--memory-snapshot``) and OOM dumps.

    ``arm()`` before the loop, ``finish()`` after it (dumps the history when recording,
    stops recording and OOM dumps); ``summary()`` names the files written.
    """

    model: nn.Module
    out_dir: Path
    rank: int
    record: bool
    files: dict[str, Any] = field(default_factory=dict)
    _armed: bool = False

    def arm(self) -> None:
        if self.record:
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks=STACKS)
        _attach_observer()
        _ACTIVE.append(self)
        self._armed = True

    def on_oom(self, device: int, requested: int, allocated: int, free: int) -> None:
        """The allocator's out-of-memory observer: dump once per run, name the files."""
        if "oom" in self.files:
            return
        from torchgpu.sizes import format_bytes

        snapshot = torch.cuda.memory._snapshot()
        paths = write_snapshot(snapshot, self.out_dir, OOM_SNAPSHOT, self.rank,
                               f"CUDA out of memory on cuda:{device}",
                               module_forwards(self.model))
        pickle_path, html_path, sites = paths
        self.files["oom"] = {"pickle": str(pickle_path), "html": str(html_path),
                             "biggest_live": [s.__dict__ for s in sites]}
        hint = ("" if self.record else " (no stacks were recorded: rerun with "
                "--memory-snapshot to see which module allocated each block)")
        print(f"CUDA out of memory on cuda:{device} (rank {self.rank}) asking for "
              f"{format_bytes(requested)} with {format_bytes(allocated)} allocated and "
              f"{format_bytes(free)} free: allocator snapshot {pickle_path}, rendered "
              f"{html_path}; biggest live allocations: {_format_sites(sites)}{hint}",
              file=sys.stderr)

    def finish(self) -> None:
        if not self._armed:
            return
        self._armed = False
        _ACTIVE.remove(self)
        if not self.record:
            return
        try:
            snapshot = torch.cuda.memory._snapshot()
            pickle_path, html_path, sites = write_snapshot(
                snapshot, self.out_dir, SNAPSHOT, self.rank, "CUDA memory of the run",
                module_forwards(self.model))
            self.files["snapshot"] = {"pickle": str(pickle_path), "html": str(html_path),
                                      "biggest_live": [s.__dict__ for s in sites]}
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    def summary(self) -> dict[str, Any]:
        return dict(self.files)


# The allocator's OOM observers cannot be detached, so one observer per process
# dispatches to the recorder of the run now in its loop (none: nothing to do).
_ACTIVE: list[MemoryRecorder] = []
_ATTACHED: list[bool] = []


def _observer(device: int, requested: int, allocated: int, free: int) -> None:
    if not _ACTIVE:
        return
    try:
        _ACTIVE[-1].on_oom(device, requested, allocated, free)
    except Exception as error:  # never turn an OOM into a different failure
        print(f"could not write the out-of-memory snapshot: {error}", file=sys.stderr)


def _attach_observer() -> None:
    if _ATTACHED:
        return
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(_observer)
        _ATTACHED.append(True)
