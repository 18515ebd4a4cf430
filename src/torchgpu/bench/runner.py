"""Run one suite by name: resolve devices, bracket it with CPU-pressure readings, write the
report. The CLI is a thin layer over :func:`run_suite`."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from torchgpu.bench.result import SuiteResult
from torchgpu.bench.suites import SUITES
from torchgpu.bench.timer import PressureMonitor
from torchgpu.errors import UsageError


def suite_names() -> list[str]:
    return list(SUITES)


def check_suite(name: str) -> str:
    """``name`` if it is a suite, else :class:`UsageError` listing the suites."""
    if name not in SUITES:
        raise UsageError(
            f"unknown bench suite {name!r}: the suites are {', '.join(SUITES)} (or `all`); "
            "run `torchgpu bench --help` for what each measures"
        )
    return name


def default_devices() -> list[torch.device]:
    """Every visible CUDA device, else the CPU. Asking initialises nothing at import time."""
    if torch.cuda.is_available():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu")]


def run_suite(
    name: str,
    quick: bool,
    out: Path,
    devices: Sequence[torch.device] | None = None,
) -> tuple[SuiteResult, dict[str, Any]]:
    """Run suite ``name`` on ``devices`` (default: :func:`default_devices`) and write its
    results.json, report.md and plots under ``out``. Returns the result and the document."""
    from torchgpu.bench.report import write_report

    module = importlib.import_module(SUITES[check_suite(name)][0])
    chosen = list(devices) if devices else default_devices()
    out.mkdir(parents=True, exist_ok=True)
    monitor = PressureMonitor()
    monitor.start()
    started = time.perf_counter()
    result: SuiteResult = module.run(quick, chosen, out)
    wall_s = time.perf_counter() - started
    pressure = monitor.stop()
    doc = write_report(result, out, pressure, wall_s)
    return result, doc
