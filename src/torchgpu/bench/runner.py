"""Run one suite by name: resolve devices, pin the thread count, bracket the run with
CPU-pressure readings, write the report. The CLI is a thin layer over :func:`run_suite`
(and turns SIGTERM into an exception while suites run, as Ctrl-C is, so a terminated
bench closes its worker groups, :mod:`torchgpu.bench.workers`, on the way out)."""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchgpu.bench.pressure import PressureMonitor
from torchgpu.bench.suites import SUITES
from torchgpu.devices.cuda_status import cuda_device_count
from torchgpu.errors import UsageError
from torchgpu.user_files import reading

if TYPE_CHECKING:
    # torch (and bench.result, whose timer imports it) only here and inside functions:
    # `torchgpu bench`'s parser reads max_threads() without importing torch.
    import torch

    from torchgpu.bench.result import SuiteResult

# Every CPU variant, in this process and in worker processes alike, runs with this many
# intra-op threads unless told otherwise: comparisons stay fair (a 2-thread variant against
# 1-thread workers measured OpenMP stalls on a loaded machine, not the technique).
DEFAULT_THREADS = 1

# What a bench run writes into its directory (plus the PNGs its results.json names).
RUN_FILES = ("results.json", "report.md", "results.json.tmp")


def check_suite(name: str) -> str:
    """``name`` if it is a suite, else :class:`UsageError` listing the suites."""
    if name not in SUITES:
        raise UsageError(
            f"unknown bench suite {name!r}: the suites are {', '.join(SUITES)} (or `all`); "
            "run `torchgpu bench --help` for what each measures"
        )
    return name


#: Intra-op threads per process at most, per CPU core (as train's --num-workers): more
#: only time-slice the cores, and far more overflow torch's 32-bit thread count.
THREADS_PER_CORE = 4


def max_threads() -> int:
    """The largest ``--threads`` this machine accepts."""
    return THREADS_PER_CORE * (os.cpu_count() or 1)


def check_threads(threads: int) -> int:
    """``threads`` if it is in 1..:func:`max_threads`, else :class:`UsageError`."""
    if not 1 <= threads <= max_threads():
        import torch

        raise UsageError(
            f"--threads {threads} is out of range: it must be in 1..{max_threads()} (at "
            f"least 1 intra-op thread per process, at most {THREADS_PER_CORE} per core of "
            f"this machine's {os.cpu_count() or 1}); pass e.g. --threads 1 (the default) or "
            f"--threads {max(1, torch.get_num_threads())}"
        )
    return threads


def prepare_out(out: Path, force: bool = False) -> Path:
    """Make ``out`` ready for a run: create it, or refuse what would mix two runs' files.

    A file at ``out``, a directory that cannot be created, or a non-empty directory
    without ``force`` raise :class:`UsageError`. With ``force`` the files an earlier bench
    run wrote there (results.json, report.md, *.png) are removed first, so no stale plot
    (say a GPU ``peak.png``) sits next to the new report; other files are left alone.
    """
    with reading(out, what="--out", fix="Give a directory you can write to, e.g. --out "
                 "runs/bench"):
        return _prepare(out, force)


def _prepare(out: Path, force: bool) -> Path:
    if out.exists() and not out.is_dir():
        raise UsageError(
            f"--out {out} is a file, not a directory: give a directory path (it is created "
            f"if missing), e.g. --out runs/bench-{out.stem or 'run'}"
        )
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir())
        if entries and not force:
            shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
            raise UsageError(
                f"--out {out} is not empty ({shown}): a new run there would mix its files "
                "with these. Give a new directory, or pass --force to replace an earlier "
                "bench run's results.json, report.md and PNGs in it"
            )
        for name in entries:
            path = out / name
            if path.is_file() and (name in RUN_FILES or name.endswith(".png")):
                path.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"--out {out}: cannot create the directory ({error.strerror or error}); give a "
            "directory you can write to, e.g. --out runs/bench"
        ) from error
    return out


def default_devices() -> list[torch.device]:
    """Every visible CUDA device, else the CPU. Asking initialises nothing at import time."""
    import torch

    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(cuda_device_count())]
    return [torch.device("cpu")]


SIZED_SUITES = ("parallel", "split-sweep")


def check_size(name: str, size: str) -> None:
    """``--size`` must be full or medium, and medium applies to the ResNet-50 experiments."""
    if size not in ("full", "medium"):
        raise UsageError(
            f"--size {size!r} is not a size: use full (the seed's sizes) or medium "
            "(the seed's ResNet-50 experiment at 64x64, one batch per run, 5 runs)."
        )
    if size == "medium" and name not in SIZED_SUITES:
        raise UsageError(
            f"--size medium applies to {' and '.join(SIZED_SUITES)} only (got {name!r}): "
            "drop --size, or name one of those suites."
        )


def run_suite(
    name: str,
    quick: bool,
    out: Path,
    devices: Sequence[torch.device] | None = None,
    threads: int = DEFAULT_THREADS,
    argv: Sequence[str] | None = None,
    size: str = "full",
) -> tuple[SuiteResult, dict[str, Any]]:
    """Run suite ``name`` on ``devices`` (default: :func:`default_devices`) and write its
    results.json, report.md and plots under ``out``. Returns the result and the document.

    ``threads``: torch's intra-op thread count for this process while the suite runs
    (restored after) and for every worker process it starts. ``argv`` is recorded as
    the command line. ``size="medium"`` (suites in :data:`SIZED_SUITES` only) runs the
    seed's experiment at a reduced image size and run count. ``out`` is created if
    missing (see :func:`prepare_out` for the checks the CLI makes first).
    """
    import torch

    from torchgpu.bench.report import write_report

    module = importlib.import_module(SUITES[check_suite(name)][0])
    check_size(name, size)
    check_threads(threads)
    chosen = list(devices) if devices else default_devices()
    out.mkdir(parents=True, exist_ok=True)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        monitor = PressureMonitor()
        monitor.start()
        started = time.perf_counter()
        result: SuiteResult = (
            module.run(quick, chosen, out, threads, size=size)
            if size != "full"
            else module.run(quick, chosen, out, threads)
        )
        wall_s = time.perf_counter() - started
        pressure = monitor.stop()
        doc = write_report(result, out, pressure, wall_s, argv=argv, threads=threads)
    finally:
        torch.set_num_threads(previous)
    return result, doc
