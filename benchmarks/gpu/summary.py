"""The GPU check's summary: the figures the project quotes, each with its goal, the seed's
claims with their verdicts, every step's outcome, and what needs 2 GPUs.

Reads only files in the results directory (``benchmarks/results/<gpu-tag>/``), so parts
run in separate device calls, unpacked into one directory, add up:

- ``kit/steps-<part>.json``: each step's record (status, exit code, time, output tail);
- ``kit/machine.json``: the GPU, torch, CUDA, driver and git revision the kit ran with;
- ``transfer/results.json``: pinned H2D GB/s, the share of copy time the Prefetcher hides;
- ``resnet50-step/results.json``: bf16 vs fp32 ResNet-50 step, torchgpu loop vs raw loop;
- ``gpt2-step/results.json``: GPT-2 small, torchgpu loop vs raw loop (eager, compiled) and
  the host syncs per optimizer step;
- ``memory/estimate.json``: ``estimate_memory`` against ``torch.cuda.max_memory_allocated``;
- ``train/<step>/summary.json``: the training runs (throughput, batch search, back-off);
- ``*/results.json``: every suite's verdicts (the seed's claims).

Writes ``summary.json`` (schema ``torchgpu.gpu-check/1``) and ``summary.md`` there. A
figure whose source is missing says which step produces it, never a made-up value.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = "torchgpu.gpu-check/1"
Doc = dict[str, Any]
PREFETCH_GOAL = 0.90
BF16_GOAL = 2.0
OVERHEAD_GOAL = 1.02
ESTIMATE_GOAL = 0.15


def _load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _figure(key: str, label: str, value: float | None, unit: str, goal: str | None,
            met: bool | None, source: str, missing: str | None = None,
            detail: str = "") -> Doc:
    return {"key": key, "label": label, "value": value, "unit": unit, "goal": goal,
            "met": met if value is not None else None, "source": source,
            "missing": missing if value is None else None, "detail": detail}


def _ratio(doc: Doc | None, numerator: str, denominator: str) -> Doc | None:
    if not doc:
        return None
    return next((r for r in doc.get("ratios", []) if r["numerator"] == numerator
                 and r["denominator"] == denominator), None)


def transfer_figures(results: Path) -> list[Doc]:
    doc = _load(results / "transfer" / "results.json")
    source = "transfer/results.json"
    rows = (doc or {}).get("measurements", [])
    pinned = [m for m in rows if m["name"].startswith("H2D pinned cuda")
              and "non_blocking" not in m["name"]]
    value = detail = None
    if pinned:
        top = max(pinned, key=lambda m: m.get("extra", {}).get("size_mib", 0))
        value = top["median"]
        pageable = next((m for m in rows if m["name"] == top["name"].replace(
            "pinned", "pageable")), None)
        detail = f"{top['name']} [{top['min']:.1f} .. {top['max']:.1f}]" + (
            f"; pageable {pageable['median']:.1f} GB/s" if pageable else "")
    figures = [_figure("pinned_h2d_gbps", "pinned host-to-device copy", value, "GB/s", None,
                       None, source, "run PART=bench (bench-transfer)", detail or "")]
    hidden = next((m for m in rows if m["name"].startswith("copy hidden by Prefetcher")), None)
    share = hidden["median"] if hidden else None
    figures.append(_figure(
        "prefetch_hidden_share", "share of copy time the Prefetcher hides", share, "fraction",
        f">= {PREFETCH_GOAL:.0%}", share is not None and share >= PREFETCH_GOAL, source,
        "run PART=bench (bench-transfer)",
        f"[{hidden['min']:.0%} .. {hidden['max']:.0%}] over rounds" if hidden else ""))
    return figures


def step_figures(results: Path) -> list[Doc]:
    doc = _load(results / "resnet50-step" / "results.json")
    source = "resnet50-step/results.json"
    missing = "run PART=bench (bench-resnet50-step)"
    speed = _ratio(doc, "raw loop fp32", "raw loop bf16")  # fp32 time / bf16 time
    train = _train_throughput_ratio(results)
    detail = f"[{speed['min']:.2f}x .. {speed['max']:.2f}x] over rounds" if speed else ""
    layout = _ratio(doc, "raw loop bf16", "raw loop bf16 channels_last")
    if layout:
        detail += f"; bf16 with a channels-last model: {layout['median']:.2f}x faster again"
    if train is not None:
        detail += f"; torchgpu train runs: {train:.2f}x the samples/s"
    figures = [_figure("bf16_vs_fp32_resnet50", "bf16 vs fp32 ResNet-50 training step",
                       speed["median"] if speed else None, "x faster", f">= {BF16_GOAL:g}x",
                       bool(speed and speed["median"] >= BF16_GOAL), source, missing, detail)]
    loop = _ratio(doc, "torchgpu loop fp32", "raw loop fp32")
    bf16 = _ratio(doc, "torchgpu loop bf16", "raw loop bf16")
    detail = f"[{loop['min']:.3f} .. {loop['max']:.3f}] over rounds" if loop else ""
    if bf16:
        detail += f"; bf16: {bf16['median']:.3f}x"
    mlp = _load(results / "overhead" / "results.json")
    for r in (mlp or {}).get("ratios", []):
        if r["numerator"].startswith("torchgpu loop"):
            detail += f"; {r['numerator']}: {r['median']:.3f}x"
    figures.append(_figure(
        "loop_overhead_resnet50", "torchgpu loop vs raw loop, ResNet-50 step time",
        loop["median"] if loop else None, "x the time", f"<= {OVERHEAD_GOAL:g}x",
        bool(loop and loop["median"] <= OVERHEAD_GOAL), source, missing, detail))
    return figures


def gpt2_figures(results: Path) -> list[Doc]:
    """GPT-2 small (gpt2_step.py): torchgpu's loop over the raw loop's time, eager and
    compiled, with the noise floor; the host syncs each optimizer step costs."""
    doc = _load(results / "gpt2-step" / "results.json")
    source = "gpt2-step/results.json"
    missing = "run PART=lm (gpt2-step)"
    rows = {m["name"]: m for m in (doc or {}).get("measurements", [])}
    figures = []
    for mode in ("eager", "compile"):
        loop = _ratio(doc, f"torchgpu loop ({mode})", f"raw loop ({mode})")
        noise = _ratio(doc, f"raw loop, second copy ({mode})", f"raw loop ({mode})")
        detail = f"[{loop['min']:.3f} .. {loop['max']:.3f}] over rounds" if loop else ""
        if noise:
            detail += f"; noise floor (raw vs raw) {noise['median']:.3f}x"
        raw = rows.get(f"raw loop ({mode})", {}).get("extra", {})
        if raw.get("step_ms"):
            detail += f"; raw step {raw['step_ms']:.1f} ms"
        figures.append(_figure(
            f"loop_overhead_gpt2_{mode}", f"torchgpu loop vs raw loop, GPT-2 small step "
            f"({mode})", loop["median"] if loop else None, "x the time",
            f"<= {OVERHEAD_GOAL:g}x", bool(loop and loop["median"] <= OVERHEAD_GOAL), source,
            missing, detail))
    ours = rows.get("torchgpu loop (eager)", {}).get("extra", {})
    per_step = ours.get("syncs_per_step")
    detail = "; ".join(
        f"{name}: {rows[name]['extra']['syncs_per_step']:.2f}" for name in rows
        if name != "torchgpu loop (eager)"
        and rows[name].get("extra", {}).get("syncs_per_step") is not None)
    figures.append(_figure(
        "host_syncs_per_step_gpt2", "host syncs per optimizer step, torchgpu loop (GPT-2, "
        "eager)", per_step, "syncs", None, None, source, missing, detail))
    return figures


def _train_throughput_ratio(results: Path) -> float | None:
    fp32 = _load(results / "train" / "train-fp32" / "summary.json") or {}
    bf16 = _load(results / "train" / "train-bf16" / "summary.json") or {}
    a, b = fp32.get("throughput_samples_per_s"), bf16.get("throughput_samples_per_s")
    return b / a if a and b else None


def estimate_figure(results: Path) -> Doc:
    doc = _load(results / "memory" / "estimate.json")
    rows = [r for r in (doc or {}).get("rows", []) if r.get("error") is not None]
    worst = max(rows, key=lambda r: abs(r["error"])) if rows else None
    detail = "; ".join(f"{r['model']} {r['precision']}: {r['error']:+.1%}" for r in rows)
    return _figure("memory_estimate_error", "estimate_memory vs max_memory_allocated "
                   "(worst model)", worst["error"] if worst else None, "error",
                   f"within {ESTIMATE_GOAL:.0%}",
                   bool(rows and all(abs(r["error"]) <= ESTIMATE_GOAL for r in rows)),
                   "memory/estimate.json", "run PART=train (estimate-memory)", detail)


def train_rows(results: Path) -> list[Doc]:
    """One row per training run: what ran, its throughput, peak and estimate, back-offs."""
    rows = []
    for path in sorted((results / "train").glob("*/summary.json")):
        s = _load(path) or {}
        device = (s.get("devices") or [{}])[0]
        rows.append({
            "step": path.parent.name, "strategy": s.get("strategy"),
            "precision": s.get("precision"), "batch_size": s.get("batch_size"),
            "world_size": s.get("world_size"),
            "samples_per_s": s.get("throughput_samples_per_s"),
            "peak_memory_bytes": device.get("peak_memory_bytes"),
            "estimated_peak_bytes": device.get("estimated_peak_bytes"),
            "oom_backoffs": len(s.get("oom_backoffs") or []),
        })
    return rows


def claims(results: Path) -> list[Doc]:
    """Every suite's verdict lines, suite by suite."""
    found = []
    for path in sorted(results.glob("*/results.json")):
        doc = _load(path) or {}
        for verdict in doc.get("verdicts", []):
            found.append({"suite": doc.get("suite", path.parent.name),
                          "dir": path.parent.name, "verdict": verdict})
    return found


def step_records(results: Path) -> list[Doc]:
    records: list[Doc] = []
    for path in sorted((results / "kit").glob("steps-*.json")):
        records += _load(path) or []
    return records


def build(results: Path, multi: Sequence[tuple[str, str, str]] = (),
          device_name: str | None = None) -> Doc:
    """The summary document of ``results`` (``multi``: (step, command, note) needing 2
    GPUs, listed as such)."""
    steps = step_records(results)
    counts: dict[str, int] = {}
    for record in steps:
        counts[record["status"]] = counts.get(record["status"], 0) + 1
    names = {r["name"] for r in steps}
    for name, _, _ in multi:
        if name not in names:
            counts["needs 2 GPUs"] = counts.get("needs 2 GPUs", 0) + 1
    suites = [_load(p) or {} for p in sorted(results.glob("*/results.json"))]
    found_names = sorted({n for d in suites for n in d.get("device_names", [])
                          if not n.lower().startswith(("amd", "intel"))})
    machine = _load(results / "kit" / "machine.json") or {}  # the kit's own record
    return {
        "schema": SCHEMA,
        "tag": results.name,
        "device_name": device_name or machine.get("gpu") or (
            found_names[0] if found_names else None),
        "torch": machine.get("torch") or next(
            (d.get("torch") for d in suites if d.get("torch")), None),
        "cuda": machine.get("cuda"),
        "driver": machine.get("driver"),
        "git": machine.get("git") or next((d.get("git") for d in suites if d.get("git")),
                                          None),
        "counts": counts,
        "figures": [*transfer_figures(results), *step_figures(results),
                    *gpt2_figures(results), estimate_figure(results)],
        "train": train_rows(results),
        "claims": claims(results),
        "steps": [{k: v for k, v in r.items() if k != "tail"} for r in steps],
        "failures": [{"name": r["name"], "problem": r.get("problem"), "tail": r.get("tail")}
                     for r in steps if r["status"] in ("fail", "timeout", "interrupted")],
        "needs_2_gpus": [{"name": n, "command": c, "note": note} for n, c, note in multi
                         if n not in names or any(r["name"] == n and r["status"] in (
                             "not run", "needs 2 GPUs") for r in steps)],
    }


def value_text(figure: Doc) -> str:
    value = figure["value"]
    if value is None:
        return f"not measured ({figure['missing']})"
    unit = figure["unit"]
    if unit == "fraction":
        return f"{value:.0%}"
    if unit == "error":
        return f"{value:+.1%}"
    if unit.startswith("x"):
        return f"{value:.3g}{unit}"
    return f"{value:.1f} {unit}"


def verdict_text(figure: Doc) -> str:
    if figure["met"] is None:
        return "—" if figure["value"] is not None else "no data"
    return "met" if figure["met"] else "missed"


def mib(value: float | None) -> str:
    return f"{value / 2**20:,.0f} MiB" if value else "—"


def render(doc: Doc) -> str:
    """summary.md: figures, claims, training runs, steps, what needs 2 GPUs, failures."""
    cuda = (f" (CUDA {doc['cuda']}" + (f", driver {doc['driver']}" if doc.get("driver") else "")
            + ")") if doc.get("cuda") else ""
    lines = [f"# GPU check: {doc['tag']}", "",
             f"{doc.get('device_name') or 'GPU name unknown'}; torch {doc.get('torch') or '?'}"
             f"{cuda}, git {doc.get('git') or '?'}; steps: "
             + (", ".join(f"{n} {k}" for k, n in doc["counts"].items()) or "none yet"), "",
             "## Figures", "", "| figure | value | goal | verdict | detail |",
             "|---|---|---|---|---|"]
    for f in doc["figures"]:
        lines.append(f"| {f['label']} | {value_text(f)} | {f['goal'] or '—'} | "
                     f"{verdict_text(f)} | {f['detail'] or f['source']} |")
    lines += ["", "## The seed's claims", ""]
    lines += [f"- **{c['dir']}**: {c['verdict']}" for c in doc["claims"]] or [
        "- no suite results yet (PART=bench)"]
    if doc["train"]:
        lines += ["", "## Training runs", "",
                  "| step | strategy | precision | batch | samples/s | peak allocated | "
                  "estimated peak | OOM back-offs |", "|---|---|---|---|---|---|---|---|"]
        for t in doc["train"]:
            speed = f"{t['samples_per_s']:.0f}" if t["samples_per_s"] else "—"
            lines.append(f"| {t['step']} | {t['strategy']} | {t['precision']} | "
                         f"{t['batch_size']} | {speed} | {mib(t['peak_memory_bytes'])} | "
                         f"{mib(t['estimated_peak_bytes'])} | {t['oom_backoffs']} |")
    lines += ["", "## Steps", "", "| part | step | status | time / limit | problem |",
              "|---|---|---|---|---|"]
    for r in doc["steps"]:
        lines.append(f"| {r['part']} | {r['name']} | {r['status']} | {r.get('seconds', 0):.0f}"
                     f" / {r.get('timeout_s') or r['budget_s']} s | {r.get('problem') or ''} |")
    if doc["needs_2_gpus"]:
        lines += ["", "## Needs 2 GPUs", "",
                  "Not run here. On a machine with 2+ GPUs: `make gpu-check PART=multi`, or "
                  "each command:", ""]
        lines += [f"- {n['name']}: `{n['command']}`" + (f" ({n['note']})" if n["note"] else "")
                  for n in doc["needs_2_gpus"]]
    for failure in doc["failures"]:
        lines += ["", f"## {failure['name']}: {failure['problem']}", "", "```",
                  (failure.get("tail") or "").strip()[-1500:], "```"]
    return "\n".join(lines) + "\n"


def write(results: Path, multi: Sequence[tuple[str, str, str]] = (),
          device_name: str | None = None) -> Doc:
    """Build the summary of ``results`` and write summary.json and summary.md there."""
    doc = build(results, multi, device_name)
    results.mkdir(parents=True, exist_ok=True)
    (results / "summary.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (results / "summary.md").write_text(render(doc))
    return doc
