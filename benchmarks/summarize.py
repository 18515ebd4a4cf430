"""Render the benchmark tables of benchmarks/README.md from the committed result files.

Reads ``benchmarks/results/<machine>/<suite>/results.json`` (``torchgpu bench NAME --out
...``) and ``benchmarks/results/<machine>/extra/<name>.json`` (benchmarks/ddp_cpu.py
and pipeline_cpu.py, run through ``python -m torchgpu.bench.extra`` by
benchmarks/run.sh). For every result: its verdicts (one line per seed claim), a link to the
JSON, the report and every plot, a warning when the CPU was contended, and its figures:

- machines without a GPU: times only as the per-round ratios the suite measured (what
  transfers between CPUs); rates (TFLOP/s, GB/s, samples/s) relative to the best row of
  the same run; memory in bytes (counts, not timings) with a ratio to the first row;
- GPU machines: absolute figures with the device name, plus the ratios and memory;
  and first, the GPU check's headline figures against their goals from
  ``benchmarks/results/<gpu-tag>/summary.json`` (``make gpu-check``, benchmarks/gpu/).

No number in the README is typed by hand.

    python benchmarks/summarize.py            # print the tables
    python benchmarks/summarize.py --write    # replace the generated part of README.md
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
ORDER = ("matmul", "transfer", "parallel", "split-sweep", "dp-ddp", "checkpointing",
         "accumulation", "overhead", "resnet50-step")
EXTRA_ORDER = ("ddp_cpu", "pipeline_cpu")
MEMORY_KEYS = {"saved_bytes": "saved for backward", "peak_allocated_bytes": "peak allocated"}
Doc = dict[str, Any]


def load(root: Path = RESULTS) -> list[tuple[Path, Doc]]:
    """Every suite results.json under ``root``, sorted by suite order then machine."""
    found = []
    for path in sorted(root.glob("*/*/results.json")):
        try:
            found.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as error:
            print(f"skipping {path}: {error}", file=sys.stderr)
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(found, key=lambda item: (rank.get(item[1]["suite"], 99), str(item[0])))


def load_extras(root: Path = RESULTS) -> list[tuple[Path, Doc]]:
    """Every extra benchmark JSON under ``root/<machine>/extra/``, wrapped or raw."""
    found = []
    for path in sorted(root.glob("*/extra/*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            print(f"skipping {path}: {error}", file=sys.stderr)
            continue
        if "result" not in data:  # the script's own --json file, copied as is
            data = {"benchmark": path.stem, "result": data}
        found.append((path, data))
    rank = {name: i for i, name in enumerate(EXTRA_ORDER)}
    return sorted(found, key=lambda item: (rank.get(item[1]["benchmark"], 99), str(item[0])))


def has_gpu(doc: Doc) -> bool:
    return any(str(d["spec"]).startswith("cuda") for d in doc["devices"])


def fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.3f} s"
    if unit == "bytes":
        return mib(value)
    if unit == "fraction":
        return f"{value * 100:.0f}%"
    return f"{value:.4g} {unit}"


def mib(value: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1 (KiB, MiB, GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(value) >= size:
            return f"{value / size:.1f} {unit}"
    return f"{value:.0f} B"


def link(path: Path, root: Path) -> str:
    return path.relative_to(root.parent).as_posix()


def noise_line(doc: Doc) -> list[str]:
    pressure = doc.get("cpu_pressure")
    if not doc.get("noisy") or not pressure:
        return []
    threshold = float(doc.get("noisy_threshold", 0.2))
    return [f"> **Timings unreliable:** the CPU was contended for "
            f"{pressure['stalled_fraction'] * 100:.0f}% of the run (threshold "
            f"{threshold * 100:.0f}%, /proc/pressure/cpu). Rerun on an idle machine.", ""]


def machine(path: Path, doc: Doc) -> str:
    names = ", ".join(doc.get("device_names", [])) or doc.get("cpu", "?")
    pressure = doc.get("cpu_pressure")
    stalled = f", CPU stalled {pressure['stalled_fraction'] * 100:.0f}%" if pressure else ""
    quick = " (quick)" if doc.get("quick") else ""
    threads = f", {doc['threads']} thread(s) per process" if "threads" in doc else ""
    git = f", git {doc['git']}" if doc.get("git") else ""
    return (f"{path.parent.parent.name}{quick}: {names}; torch {doc.get('torch', '?')}"
            f"{git}{threads}{stalled}")


def header(path: Path, doc: Doc, root: Path) -> list[str]:
    files = [f"[results.json]({link(path, root)})"]
    if (path.parent / "report.md").exists():
        files.append(f"[report.md]({link(path.parent / 'report.md', root)})")
    plots = [f"[{p['filename']}]({link(path.parent / p['filename'], root)})"
             for p in doc.get("plots", [])]
    lines = [f"*{machine(path, doc)}* — {' · '.join(files)}"
             + (f" · plots: {', '.join(plots)}" if plots else ""), ""]
    lines += noise_line(doc)
    lines += [f"- {verdict}" for verdict in doc.get("verdicts", [])]
    if doc.get("verdicts"):
        lines.append("")
    return lines


def best_marked(doc: Doc) -> set[str]:
    return {m["name"] for m in doc["measurements"] if m.get("extra", {}).get("best")}


def ratio_table(doc: Doc) -> list[str]:
    if not doc["ratios"]:
        return []
    best = best_marked(doc)
    lines = ["| ratio (per round) | median | min .. max |", "|---|---|---|"]
    for r in doc["ratios"]:
        star = " ★ best" if r["numerator"] in best else ""
        lines.append(f"| {r['name']}{star} | {r['median']:.3f} | "
                     f"{r['min']:.3f} .. {r['max']:.3f} |")
    return [*lines, ""]


def absolute_table(doc: Doc) -> list[str]:
    """Every measurement with its unit (GPU machines)."""
    best = best_marked(doc)
    lines = ["| figure | median | min .. max | n | threads |", "|---|---|---|---|---|"]
    for m in doc["measurements"]:
        star = " ★ best" if m["name"] in best else ""
        lines.append(f"| {m['name']}{star} | {fmt(m['median'], m['unit'])} | "
                     f"{fmt(m['min'], m['unit'])} .. {fmt(m['max'], m['unit'])} | {m['n']} | "
                     f"{m.get('threads', '?')} |")
    return [*lines, ""]


def relative_rates(doc: Doc) -> list[str]:
    """CPU machines: rate rows (TFLOP/s, GB/s, samples/s) relative to the best row of their
    unit in the same run -- a ratio of medians, since rows of different sizes come from
    different interleaved runs."""
    rows = [m for m in doc["measurements"] if m["unit"] not in ("s", "bytes", "fraction")]
    if not rows:
        return []
    lines = ["| figure | relative to the best row (median) | best row |", "|---|---|---|"]
    for unit in dict.fromkeys(m["unit"] for m in rows):
        group = [m for m in rows if m["unit"] == unit]
        top = max(group, key=lambda m: m["median"])
        for m in group:
            share = m["median"] / top["median"] if top["median"] else float("nan")
            lines.append(f"| {m['name']} ({unit}) | {share:.3f} | {top['name']} |")
    return [*lines, ""]


def memory_table(doc: Doc) -> list[str]:
    """Byte figures: measurements in bytes, and the memory keys of ``extra``."""
    lines: list[str] = []
    byte_rows = [m for m in doc["measurements"] if m["unit"] == "bytes"]
    if byte_rows:
        first = byte_rows[0]
        kind = first.get("extra", {}).get("kind", "bytes")
        lines += [f"| memory ({kind}) | value | vs {first['name']} |", "|---|---|---|"]
        for m in byte_rows:
            lines.append(f"| {m['name']} | {mib(m['median'])} | "
                         f"{m['median'] / first['median']:.2f}x |")
        lines.append("")
    for key, what in MEMORY_KEYS.items():
        rows = [m for m in doc["measurements"] if key in m.get("extra", {})]
        if not rows:
            continue
        base = rows[0]["extra"][key]
        lines += [f"| memory: {what} | value | vs {rows[0]['name']} |", "|---|---|---|"]
        for m in rows:
            value = m["extra"][key]
            share = f"{value / base:.2f}x" if base else "n/a"
            lines.append(f"| {m['name']} | {mib(value)} | {share} |")
        lines.append("")
    return lines


def table(path: Path, doc: Doc, root: Path) -> list[str]:
    """One suite result on one machine."""
    lines = header(path, doc, root)
    if has_gpu(doc):
        lines += absolute_table(doc) + ratio_table(doc)
    else:
        lines += ratio_table(doc) + relative_rates(doc)
    lines += memory_table(doc)
    return lines


# --- the extra CPU benchmarks (their own JSON layouts) ------------------------------------


def extra_header(path: Path, doc: Doc, root: Path) -> list[str]:
    pressure = doc.get("cpu_pressure")
    stalled = f", CPU stalled {pressure['stalled_fraction'] * 100:.0f}%" if pressure else ""
    result = doc["result"]
    threads = result.get("threads", result.get("config", {}).get("threads", 1))
    git = f", git {doc['git']}" if doc.get("git") else ""
    quick = " (quick)" if "--quick" in doc.get("command", []) else ""
    what = (f"{path.parent.parent.name}{quick}: {doc.get('cpu', '?')}; torch "
            f"{doc.get('torch', result.get('torch', '?'))}{git}, {threads} thread(s) per "
            f"process{stalled}")
    return [f"*{what}* — [{path.name}]({link(path, root)})", "", *noise_line(doc)]


def per_round(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median, min and max of ``a_i / b_i`` over rounds."""
    values = [x / y for x, y in zip(a, b, strict=True) if y > 0]
    return statistics.median(values), min(values), max(values)


def ddp_extra(result: Doc) -> list[str]:
    rows = [(f"weak-scaling efficiency, {k} (1.0 = perfect)", v)
            for k, v in result.get("weak_scaling_efficiency", {}).items()]
    rows.append(("torchgpu DDP loop vs hand-written DDP loop (speed)",
                 result.get("torchgpu_vs_raw_ddp")))
    if "torchgpu_vs_raw_ddp_logged" in result:
        rows.append(("torchgpu DDP loop vs hand-written loop reading the loss (speed)",
                     result["torchgpu_vs_raw_ddp_logged"]))
    lines = [f"- MLP 13-{result.get('hidden', '?')}-{result.get('hidden', '?')}-1, batch "
             f"{result.get('batch_per_process', '?')} per process; "
             f"{result.get('processes', 2)} processes x {result.get('threads', 1)} thread, "
             f"{result.get('steps', '?')} steps per sample, {result.get('rounds', '?')} rounds "
             "(weak scaling rises with the work per step: gloo's all-reduce is a fixed cost)",
             "", "| ratio (per-round median) | value |", "|---|---|"]
    lines += [f"| {name} | {value:.3f} |" for name, value in rows if value is not None]
    return [*lines, ""]


def pipeline_extra(result: Doc) -> list[str]:
    times = result["times"]
    lines = []
    if "naive" in times:
        naive = times["naive"]["samples"]
        lines += ["| variant | speed-up over naive model parallel (per round) | min .. max |",
                  "|---|---|---|"]
        for name, t in times.items():
            med, lo, hi = per_round(naive, t["samples"])
            lines.append(f"| {name} | {med:.3f} | {lo:.3f} .. {hi:.3f} |")
        lines.append("")
        if "auto" in times:
            med, lo, hi = per_round(naive, times["auto"]["samples"])
            verdict = "met" if med >= 1.40 else "missed here"
            lines.append(f"- auto-chosen pipeline vs naive model parallel: {med:.3f}x the "
                         f"speed [{lo:.3f} .. {hi:.3f}] (target >= 1.40x: {verdict})")
        torch_names = [name for name in times if name.startswith("torch-")]
        if torch_names:
            best = max(torch_names, key=lambda n: per_round(naive, times[n]["samples"])[0])
            lines.append(f"- best hand-picked torch.distributed.pipelining ({best}) vs naive: "
                         f"{per_round(naive, times[best]['samples'])[0]:.3f}x the speed")
        if "single" in times:
            med, lo, hi = per_round(naive, times["single"]["samples"])
            lines += [f"- naive model parallel vs one process, one thread: {med:.3f}x the "
                      f"time [{lo:.3f} .. {hi:.3f}] (target: within ±5%)", ""]
    ranks = result.get("ranks", [])
    if ranks:
        lines += ["| stage (rank) | peak RSS | memory per variant: parameters + activations |",
                  "|---|---|---|"]
        for r in ranks:
            parts = [f"{k} {mib(m['param_bytes'])} + {mib(m['activation_bytes'])}"
                     for k, m in r.get("memory", {}).items() if "param_bytes" in m]
            lines.append(f"| {r['rank']} | {mib(r['peak_rss_bytes'])} | {'; '.join(parts)} |")
        lines.append("")
    return lines


def demo_extra(result: Doc) -> list[str]:
    rows = result.get("rows", [])
    compiled = ("torchgpu byte-compiled first" if result.get("compiled")
                else "torchgpu not byte-compiled first")
    lines = [f"- whole processes, housing, {result.get('epochs', '?')} epochs, "
             f"{result.get('rounds', '?')} interleaved rounds ({compiled}); ratio = median "
             "of per-round ratios to the plain script", "",
             "| process | median | ratio to the plain script | min .. max |", "|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['median_s']:.2f} s | {r['ratio_to_plain']:.3f} | "
              f"{r['ratio_min']:.3f} .. {r['ratio_max']:.3f} |" for r in rows]
    ours = [r for r in rows if r["name"].startswith("torchgpu")]
    noise = [r for r in rows if "second copy" in r["name"]]
    target = result.get("target_ratio", 1.05)
    if ours:
        verdict = "met" if ours[0]["ratio_to_plain"] <= target else "missed here"
        beside = (f" (noise row: {noise[0]['ratio_to_plain']:.3f})" if noise else "")
        lines += ["", f"- `make demo` vs the plain script: {ours[0]['ratio_to_plain']:.3f}x the "
                  f"time{beside} (target <= {target:.2f}x: {verdict})"]
    return [*lines, ""]


def sharded_extra(result: Doc) -> list[str]:
    """benchmarks/sharded_save_cpu.py: sharded vs gathered FSDP2 checkpoint."""
    lines = [f"Model {result['model_fp32_mib']} MiB fp32 ({result['with_adam_mib']} MiB with "
             f"Adam), {result['world_size']} gloo ranks, {result['rounds']} rounds, medians.", "",
             "| variant | save s | peak RSS above the start, by rank (MiB) |", "|---|---|---|"]
    for name in ("sharded", "gathered"):
        row = result["summary"][name]
        lines.append(f"| {name} | {row['seconds_median']:.3f} | "
                     f"{', '.join(f'{v:.0f}' for v in row['peak_rss_above_mib_by_rank'])} |")
    ratio = result["ratio_gathered_over_sharded"]
    lines += ["", f"- gathered / sharded: {ratio['seconds']:.2f}x the time, "
              f"{ratio['peak_rss_rank0']:.1f}x rank 0's peak RSS"]
    return [*lines, ""]


EXTRA_RENDERERS: dict[str, tuple[str, Callable[[Doc], list[str]]]] = {
    "sharded_save_cpu": ("benchmarks/sharded_save_cpu.py: sharded vs gathered FSDP2 "
                         "checkpoint on 2 CPU processes", sharded_extra),
    "demo_vs_script": ("benchmarks/demo_vs_script.py: `make demo` vs a plain PyTorch script",
                       demo_extra),
    "ddp_cpu": ("benchmarks/ddp_cpu.py: DDP on 2 CPU processes", ddp_extra),
    "pipeline_cpu": ("benchmarks/pipeline_cpu.py: pipeline on 2 CPU processes",
                     pipeline_extra),
}


# --- the GPU check's headline figures (benchmarks/gpu/kit.py writes summary.json) --------

GPU_CHECK_SCHEMA = "torchgpu.gpu-check/1"


def load_gpu_checks(root: Path = RESULTS) -> list[tuple[Path, Doc]]:
    """Every ``<machine>/summary.json`` the GPU check wrote, by machine."""
    found = []
    for path in sorted(root.glob("*/summary.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            print(f"skipping {path}: {error}", file=sys.stderr)
            continue
        if doc.get("schema") == GPU_CHECK_SCHEMA:
            found.append((path, doc))
    return found


def gpu_figure_value(figure: Doc) -> str:
    value, unit = figure.get("value"), figure.get("unit", "")
    if value is None:
        return f"not measured ({figure.get('missing')})"
    if unit == "fraction":
        return f"{value * 100:.0f}%"
    if unit == "error":
        return f"{value * 100:+.1f}%"
    if unit.startswith("x"):
        return f"{value:.3g}{unit}"
    return f"{value:.1f} {unit}"


def gpu_check(path: Path, doc: Doc, root: Path) -> list[str]:
    """One machine's GPU check: the quoted figures against their goals, the steps'
    outcome, and what needs 2 GPUs; the suites' own rows follow in their sections."""
    counts = ", ".join(f"{n} {status}" for status, n in doc.get("counts", {}).items())
    lines = [f"### GPU check: {doc.get('tag', path.parent.name)}", "",
             f"*{doc.get('device_name') or '?'}; torch {doc.get('torch') or '?'}, git "
             f"{doc.get('git') or '?'}; steps: {counts or 'none run'}* — "
             f"[summary.md]({link(path.parent / 'summary.md', root)}) · "
             f"[summary.json]({link(path, root)})", "",
             "| figure | value | goal | verdict | detail |", "|---|---|---|---|---|"]
    for f in doc.get("figures", []):
        met = f.get("met")
        verdict = ("met" if met else "missed") if met is not None else (
            "—" if f.get("value") is not None else "no data")
        lines.append(f"| {f['label']} | {gpu_figure_value(f)} | {f.get('goal') or '—'} | "
                     f"{verdict} | {f.get('detail') or f.get('source', '')} |")
    lines.append("")
    failed = [s["name"] for s in doc.get("steps", []) if s.get("status") in ("fail",
                                                                              "timeout")]
    if failed:
        lines += [f"- steps that failed: {', '.join(failed)} (see summary.md)", ""]
    multi = doc.get("needs_2_gpus", [])
    if multi:
        lines += [f"- needs 2 GPUs, not run here: {', '.join(m['name'] for m in multi)} "
                  "(`make gpu-check PART=multi` on such a machine)", ""]
    return lines


def render(root: Path = RESULTS) -> str:
    """The generated Markdown: the GPU checks' headline figures, then one section per suite
    and extra benchmark, one table each per machine (CPU and GPU rows side by side)."""
    results, extras, checks = load(root), load_extras(root), load_gpu_checks(root)
    if not results and not extras and not checks:
        return "_No result files yet: run `make bench` (benchmarks/run.sh)._\n"
    out: list[str] = []
    for path, doc in checks:
        out += gpu_check(path, doc, root)
    current = None
    for path, doc in results:
        if doc["suite"] != current:
            current = doc["suite"]
            out += [f"### {current}", ""]
        out += table(path, doc, root)
    current = None
    for path, doc in extras:
        name = doc["benchmark"]
        title, renderer = EXTRA_RENDERERS.get(name, (f"benchmarks/{name}.py", _raw_extra))
        if name != current:
            current = name
            out += [f"### {title}", ""]
        out += extra_header(path, doc, root)
        try:
            out += renderer(doc["result"])
        except (KeyError, TypeError, ValueError) as error:
            out += [f"_could not read this file's layout ({type(error).__name__}: {error})._",
                    ""]
    return "\n".join(out)


def _raw_extra(result: Doc) -> list[str]:
    return ["```json", json.dumps(result, indent=2)[:2000], "```", ""]


def write(readme: Path = README, root: Path = RESULTS) -> None:
    """Replace the text between the BEGIN and END markers of ``readme``."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{render(root)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--write", action="store_true", help="update benchmarks/README.md")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.write:
        write(README, args.results)
    else:
        print(render(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
