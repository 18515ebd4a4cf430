"""Write a suite's results: ``results.json`` (stable schema), ``report.md``, PNG plots, and a
rich table for the console.

results.json schema (``"schema": "torchgpu.bench/2"``)::

    suite, quick, created (UTC ISO time), wall_s, argv (the command line, or null),
    torchgpu (version), git (``git describe --always`` plus "-dirty", or null),
    torch, cuda (torch.version.cuda or null), python, platform, cpu (model name), cpu_count,
    devices: [{"spec", "name"}], device_names: [str],
    threads (torch intra-op threads of the measuring process; each measurement records
    its own, worker processes included),
    cpu_pressure: {avg10_start, avg10_end, stalled_us, wall_s, stalled_fraction} | null,
    noisy (stalled_fraction above noisy_threshold: timings unreliable), noisy_threshold,
    config: {...}, measurements: [Measurement.to_json()], ratios: [Ratio.to_json()],
    verdicts: [str], notes: [str], plots: [Plot.to_json()]

Version 2 added argv, torchgpu, git, cuda, noisy, noisy_threshold and verdicts; matmul's
ratios became TFLOP/s ratios (GPU/CPU) instead of time ratios.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from torchgpu.bench.plots import write_plot
from torchgpu.bench.pressure import NOISY_STALLED_FRACTION, CpuPressure
from torchgpu.bench.result import SuiteResult
from torchgpu.bench.timer import Measurement, Ratio
from torchgpu.devices.cuda_status import cuda_device_count
from torchgpu.devices.host import cpu_name

SCHEMA = "torchgpu.bench/2"


def default_out(name: str, now: _dt.datetime | None = None) -> Path:
    """``runs/bench-<name>-<YYYYmmdd-HHMMSS>/`` relative to the working directory."""
    stamp = (now or _dt.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"bench-{name}-{stamp}"


def device_name(spec: str) -> str:
    """A human name for a device spec; CUDA names are asked for only for CUDA specs."""
    device = torch.device(spec)
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device.index or 0))
    if device.type == "cpu":
        return cpu_name()
    return device.type


def git_revision(where: Path | None = None) -> str | None:
    """``git describe --always`` of the checkout holding torchgpu (plus ``-dirty`` when
    tracked files differ from HEAD), or None outside a git checkout or without git.

    Read-only on purpose: ``describe --dirty`` and ``status`` may rewrite the index, which
    would race with someone committing in the same checkout.
    """
    here = where or Path(__file__).resolve().parent
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", "-C", str(here), *args], capture_output=True, text=True,
                              timeout=10, env=env, check=False)

    try:
        described = git("describe", "--always")
        if described.returncode != 0 or not described.stdout.strip():
            return None
        dirty = git("diff-index", "--quiet", "HEAD", "--").returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return described.stdout.strip() + ("-dirty" if dirty else "")


def torchgpu_version() -> str:
    from torchgpu.version import __version__

    return str(__version__)


def results_document(
    result: SuiteResult,
    pressure: CpuPressure | None,
    wall_s: float,
    plots: Sequence[str] = (),
    created: _dt.datetime | None = None,
    argv: Sequence[str] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """The results.json content for ``result`` (see the module docstring for the schema).

    ``threads``: the intra-op thread count the run was given (default: torch's current).
    """
    when = created or _dt.datetime.now(_dt.timezone.utc)
    devices = [{"spec": spec, "name": device_name(spec)} for spec in result.devices]
    return {
        "schema": SCHEMA,
        "suite": result.suite,
        "quick": result.quick,
        "created": when.isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "argv": list(argv) if argv is not None else None,
        "torchgpu": torchgpu_version(),
        "git": git_revision(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count() or 1,
        "devices": devices,
        "device_names": sorted({d["name"] for d in devices}),
        "threads": torch.get_num_threads() if threads is None else threads,
        "cpu_pressure": pressure.to_json() if pressure is not None else None,
        "noisy": pressure.noisy if pressure is not None else False,
        "noisy_threshold": NOISY_STALLED_FRACTION,
        "config": result.config,
        "measurements": [m.to_json() for m in result.measurements],
        "ratios": [r.to_json() for r in result.ratios],
        "verdicts": list(result.verdicts),
        "notes": list(result.notes),
        "plots": [p.to_json() for p in result.plots if p.filename in plots],
    }


def noise_warning(doc: dict[str, Any]) -> str | None:
    """The "timings unreliable" sentence for a noisy run, else None."""
    pressure = doc.get("cpu_pressure")
    if not doc.get("noisy") or not pressure:
        return None
    threshold = float(doc.get("noisy_threshold", NOISY_STALLED_FRACTION))
    return (f"timings unreliable: the CPU was contended for "
            f"{pressure['stalled_fraction'] * 100:.0f}% of the run (runnable tasks waiting "
            f"for a CPU, from /proc/pressure/cpu; the threshold is {threshold * 100:.0f}%). "
            "Rerun on an idle machine before trusting these figures.")


def load_results(path: Path) -> dict[str, Any]:
    """Read a results.json (a file or the directory holding it)."""
    file = path / "results.json" if path.is_dir() else path
    data: dict[str, Any] = json.loads(file.read_text())
    return data


def format_value(value: float, unit: str) -> str:
    """Readable number with its unit: seconds become ms/µs when small, bytes KiB..GiB."""
    if unit == "bytes":
        return format_bytes(value)
    if unit == "s":
        if value == 0 or abs(value) >= 1:
            return f"{value:.3f} s"
        if abs(value) >= 1e-3:
            return f"{value * 1e3:.2f} ms"
        return f"{value * 1e6:.1f} µs"
    if abs(value) >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.3g} {unit}"


def format_bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.2f} {unit}"
    return f"{value:.0f} B"


def _spread(m: Measurement) -> str:
    if m.unit in ("s", "bytes"):
        return f"[{format_value(m.min, m.unit)} .. {format_value(m.max, m.unit)}]"
    return f"[{m.min:.3g} .. {m.max:.3g}]"


def _extras(m: Measurement) -> str:
    parts = []
    for key, value in m.extra.items():
        if key.endswith("_bytes") and isinstance(value, int | float):
            parts.append(f"{key}={format_bytes(value)}")
        elif isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif isinstance(value, int | str | bool):
            parts.append(f"{key}={value}")
    return ", ".join(parts)


def render_markdown(doc: dict[str, Any]) -> str:
    """report.md text from a results document (so it can be re-rendered from JSON)."""
    measurements = [Measurement.from_json(m) for m in doc["measurements"]]
    ratios = [Ratio.from_json(r) for r in doc["ratios"]]
    lines = [f"# torchgpu bench {doc['suite']}{' (quick)' if doc['quick'] else ''}", ""]
    warning = noise_warning(doc)
    if warning:
        lines += [f"**{warning}**", ""]
    lines += [
        f"- devices: {', '.join(d['spec'] + ' (' + d['name'] + ')' for d in doc['devices'])}",
        f"- torchgpu {doc.get('torchgpu')} (git {doc.get('git') or 'n/a'}), torch "
        f"{doc['torch']} (CUDA {doc.get('cuda') or 'none'}), Python {doc['python']}, "
        f"{doc['cpu_count']} CPUs, {doc['threads']} torch thread(s) per process",
        f"- created {doc['created']}, wall time {doc['wall_s']:.1f} s",
    ]
    if doc.get("argv"):
        lines.append(f"- command: `{' '.join(doc['argv'])}`")
    pressure = doc.get("cpu_pressure")
    if pressure:
        lines.append(
            f"- CPU pressure: some-avg10 {pressure['avg10_start']:.1f}% -> "
            f"{pressure['avg10_end']:.1f}%, runnable tasks stalled "
            f"{pressure['stalled_fraction'] * 100:.1f}% of the wall time"
        )
    else:
        lines.append("- CPU pressure: not available (/proc/pressure/cpu missing)")
    if doc["config"]:
        cfg = ", ".join(f"{k}={v}" for k, v in doc["config"].items())
        lines.append(f"- config: {cfg}")
    if doc.get("verdicts"):
        lines += ["", "## Verdicts", ""] + [f"- {v}" for v in doc["verdicts"]]
    lines += ["", "## Measurements", "",
              "Median of the rounds, with [min .. max]; variants interleaved per round.", "",
              "| variant | median | min .. max | n | threads | details |",
              "|---|---|---|---|---|---|"]
    for m in measurements:
        lines.append(
            f"| {m.name} | {format_value(m.median, m.unit)} | {_spread(m)} | {m.n} "
            f"| {m.threads} | {_extras(m)} |"
        )
    if ratios:
        lines += ["", "## Ratios", "",
                  "Per-round ratio of the two variants' samples, median [min .. max].", "",
                  "| ratio | median | min .. max |", "|---|---|---|"]
        for r in ratios:
            lines.append(f"| {r.name} | {r.median:.3f} | [{r.min:.3f} .. {r.max:.3f}] |")
    if doc["notes"]:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in doc["notes"]]
    if doc["plots"]:
        lines += ["", "## Plots", ""]
        lines += [f"![{p['title']}]({p['filename']})" for p in doc["plots"]]
    return "\n".join(lines) + "\n"


def plot_subtitle(result: SuiteResult) -> str:
    """Devices and size for every plot's title, e.g. "cpu (AMD EPYC), quick"."""
    devices = ", ".join(f"{spec} ({device_name(spec)})" for spec in result.devices)
    return f"{devices}; {'quick' if result.quick else 'full size'}"


def write_report(
    result: SuiteResult, out: Path, pressure: CpuPressure | None, wall_s: float,
    argv: Sequence[str] | None = None, threads: int | None = None,
) -> dict[str, Any]:
    """Write results.json, report.md and the PNGs under ``out``; return the results document.

    results.json is written last, through a temporary name, so a directory holding one
    always holds a finished report.
    """
    out.mkdir(parents=True, exist_ok=True)
    by_name = dict(result.by_name())
    subtitle = plot_subtitle(result)
    written = [p.filename for p in result.plots
               if write_plot(p, by_name, out, subtitle) is not None]
    doc = results_document(result, pressure, wall_s, plots=written, argv=argv, threads=threads)
    (out / "report.md").write_text(render_markdown(doc))
    tmp = out / "results.json.tmp"
    tmp.write_text(dumps(doc) + "\n")
    tmp.replace(out / "results.json")
    return doc


def print_table(doc: dict[str, Any], out: Path | None = None) -> None:
    """A rich table of the measurements and ratios on stdout."""
    from rich.table import Table

    from torchgpu.console import make_console

    console = make_console()
    table = Table(title=f"torchgpu bench {doc['suite']}" + (" (quick)" if doc["quick"] else ""))
    for column in ("variant", "median", "min .. max", "n", "threads", "details"):
        table.add_column(column, justify="right" if column in ("median", "n", "threads")
                         else "left")
    for data in doc["measurements"]:
        m = Measurement.from_json(data)
        table.add_row(m.name, format_value(m.median, m.unit), _spread(m), str(m.n),
                      str(m.threads), _extras(m))
    console.print(table)
    for data in doc["ratios"]:
        r = Ratio.from_json(data)
        console.print(f"  {r.name}: {r.median:.3f}  [{r.min:.3f} .. {r.max:.3f}]")
    for verdict in doc.get("verdicts", []):
        console.print(f"  verdict: {verdict}", highlight=False)
    for note in doc["notes"]:
        console.print(f"  note: {note}", highlight=False)
    pressure = doc.get("cpu_pressure")
    if pressure:
        console.print(
            f"  CPU pressure: stalled {pressure['stalled_fraction'] * 100:.1f}% of "
            f"{pressure['wall_s']:.1f} s (some-avg10 {pressure['avg10_end']:.1f}%)",
            highlight=False,
        )
    warning = noise_warning(doc)
    if warning:
        console.print(f"  [bold red]{warning}[/]", highlight=False)
    if out is not None:
        console.print(f"  written to {out}/ (results.json, report.md, plots)", highlight=False)


def machine_tag() -> str:
    """A directory-safe name for this machine's results: ``<N>x-<gpu name>`` or
    ``cpu-<N>c-<cpu model>`` (e.g. ``1x-nvidia-h100-80gb-hbm3``, ``cpu-2c-amd-epyc``)."""
    import re

    def slug(text: str) -> str:
        return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]

    if torch.cuda.is_available():
        count = cuda_device_count()
        return f"{count}x-{slug(torch.cuda.get_device_name(0))}"
    return f"cpu-{os.cpu_count() or 1}c-{slug(cpu_name())}"


def dumps(data: object) -> str:
    """JSON text for results (indent 2, infinities as strings so the file stays valid JSON)."""
    return json.dumps(_finite(data), indent=2, sort_keys=False)


def _finite(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
