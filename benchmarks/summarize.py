"""Render the benchmark tables of benchmarks/README.md from the committed result files.

Reads ``benchmarks/results/<machine>/<suite>/results.json`` (written by
``torchgpu bench NAME --out ...``; see benchmarks/run.sh) and prints one table per suite:
machines without a GPU as ratios (what transfers between CPUs), GPU machines as absolute
figures with the device name, plus their ratios. Every figure links to its result file,
so no number in the README is typed by hand.

    python benchmarks/summarize.py            # print the tables
    python benchmarks/summarize.py --write    # replace the generated part of README.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
ORDER = ("matmul", "transfer", "parallel", "split-sweep", "dp-ddp", "checkpointing",
         "accumulation", "overhead")


def load(root: Path = RESULTS) -> list[tuple[Path, dict[str, Any]]]:
    """Every results.json under ``root``, sorted by suite order then machine."""
    found = []
    for path in sorted(root.glob("*/*/results.json")):
        try:
            found.append((path, json.loads(path.read_text())))
        except (OSError, json.JSONDecodeError) as error:
            print(f"skipping {path}: {error}", file=sys.stderr)
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(found, key=lambda item: (rank.get(item[1]["suite"], 99), str(item[0])))


def has_gpu(doc: dict[str, Any]) -> bool:
    return any(str(d["spec"]).startswith("cuda") for d in doc["devices"])


def fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1e3:.2f} ms" if value < 1 else f"{value:.3f} s"
    if unit == "bytes":
        return f"{value / 2**20:.1f} MiB"
    return f"{value:.4g} {unit}"


def machine(path: Path, doc: dict[str, Any]) -> str:
    names = ", ".join(doc.get("device_names", [])) or "?"
    pressure = doc.get("cpu_pressure")
    stalled = f", CPU stalled {pressure['stalled_fraction'] * 100:.0f}%" if pressure else ""
    quick = " (quick)" if doc.get("quick") else ""
    return (f"{path.parent.parent.name}{quick}: {names}; torch {doc['torch']}, "
            f"{doc['threads']} threads{stalled}")


def table(path: Path, doc: dict[str, Any], root: Path) -> list[str]:
    rel = path.relative_to(root.parent).as_posix()
    lines = [f"*{machine(path, doc)}* — [results.json]({rel})", ""]
    if has_gpu(doc):
        lines += ["| figure | median | min .. max | n |", "|---|---|---|---|"]
        for m in doc["measurements"]:
            lines.append(f"| {m['name']} | {fmt(m['median'], m['unit'])} | "
                         f"{fmt(m['min'], m['unit'])} .. {fmt(m['max'], m['unit'])} | {m['n']} |")
        lines.append("")
    if doc["ratios"]:
        lines += ["| ratio (per round) | median | min .. max |", "|---|---|---|"]
        for r in doc["ratios"]:
            lines.append(f"| {r['name']} | {r['median']:.3f} | {r['min']:.3f} .. {r['max']:.3f} |")
    elif not has_gpu(doc):
        lines += ["| figure | median | min .. max | n |", "|---|---|---|---|"]
        for m in doc["measurements"]:
            lines.append(f"| {m['name']} | {fmt(m['median'], m['unit'])} | "
                         f"{fmt(m['min'], m['unit'])} .. {fmt(m['max'], m['unit'])} | {m['n']} |")
    lines.append("")
    return lines


def render(root: Path = RESULTS) -> str:
    """The generated Markdown: one section per suite, one table per machine."""
    results = load(root)
    if not results:
        return "_No result files yet: run `make bench` (benchmarks/run.sh)._\n"
    out: list[str] = []
    current = None
    for path, doc in results:
        if doc["suite"] != current:
            current = doc["suite"]
            out += [f"### {current}", ""]
        out += table(path, doc, root)
    return "\n".join(out)


def write(readme: Path = README, root: Path = RESULTS) -> None:
    """Replace the text between the BEGIN and END markers of ``readme``."""
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} section to fill")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{render(root)}\n{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
