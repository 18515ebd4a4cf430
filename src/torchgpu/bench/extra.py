"""Run one of the stand-alone CPU benchmarks (``benchmarks/ddp_cpu.py``,
``pipeline_cpu.py``, ``demo_vs_script.py``) and keep its ``--json`` output with the
context ``torchgpu bench`` records: versions, git revision, CPU, command line, CPU
pressure over the run.

    python -m torchgpu.bench.extra benchmarks/pipeline_cpu.py OUT.json [SCRIPT ARGS...]

OUT.json (``"schema": "torchgpu.bench-extra/1"``)::

    benchmark (the script's stem), command, created, wall_s, returncode, torchgpu, git,
    torch, python, platform, cpu, cpu_count, cpu_pressure, noisy, noisy_threshold,
    result (the script's own JSON, unchanged)

OUT.json is written only when the script succeeded and wrote its JSON (through a
temporary name), so a results directory never holds half a run. benchmarks/summarize.py
renders these files; benchmarks/run.sh runs them with ``EXTRAS=...``.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = "torchgpu.bench-extra/1"
EXTRAS = ("ddp_cpu", "pipeline_cpu", "demo_vs_script", "sharded_save_cpu")


def run_extra(script: Path, out: Path, args: Sequence[str] = (),
              timeout_s: float = 3600.0) -> dict[str, Any]:
    """Run ``python SCRIPT --json TMP ARGS...`` and write the wrapped document to ``out``.

    Raises RuntimeError (with the script's exit code) when it fails or writes no JSON.
    """
    import torch

    from torchgpu.bench.pressure import NOISY_STALLED_FRACTION, PressureMonitor
    from torchgpu.bench.report import git_revision, torchgpu_version
    from torchgpu.devices.host import cpu_name

    with tempfile.TemporaryDirectory() as tmp:
        produced = Path(tmp) / "result.json"
        command = [sys.executable, str(script), "--json", str(produced), *args]
        monitor = PressureMonitor()
        monitor.start()
        started = time.perf_counter()
        proc = subprocess.run(command, timeout=timeout_s, check=False)
        wall_s = time.perf_counter() - started
        pressure = monitor.stop()
        if proc.returncode != 0 or not produced.exists():
            raise RuntimeError(f"{script} exited with code {proc.returncode}"
                               + ("" if produced.exists() else " and wrote no JSON"))
        result = json.loads(produced.read_text())
    doc = {
        "schema": SCHEMA,
        "benchmark": script.stem,
        "command": ["python", str(script), "--json", "FILE", *args],
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": wall_s,
        "returncode": proc.returncode,
        "torchgpu": torchgpu_version(),
        "git": git_revision(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count() or 1,
        "cpu_pressure": pressure.to_json() if pressure is not None else None,
        "noisy": pressure.noisy if pressure is not None else False,
        "noisy_threshold": NOISY_STALLED_FRACTION,
        "result": result,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_name(out.name + ".tmp")
    tmp_out.write_text(json.dumps(doc, indent=2) + "\n")
    tmp_out.replace(out)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print("usage: python -m torchgpu.bench.extra SCRIPT OUT.json [SCRIPT ARGS...]",
              file=sys.stderr)
        return 2
    script, out = Path(args[0]), Path(args[1])
    if not script.is_file():
        print(f"torchgpu: {script} is not a file: give the benchmark script's path, e.g. "
              "benchmarks/ddp_cpu.py", file=sys.stderr)
        return 2
    try:
        doc = run_extra(script, out, args[2:])
    except RuntimeError as error:
        print(f"torchgpu: {error}", file=sys.stderr)
        return 1
    pressure = doc["cpu_pressure"]
    stalled = f", CPU stalled {pressure['stalled_fraction'] * 100:.0f}%" if pressure else ""
    print(f"wrote {out} ({doc['wall_s']:.1f} s{stalled})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
