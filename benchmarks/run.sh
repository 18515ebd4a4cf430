#!/usr/bin/env bash
# Run the bench suites at full size into benchmarks/results/<machine-tag>/<suite>/ and,
# when asked, the extra CPU benchmarks (ddp_cpu.py, pipeline_cpu.py) into
# benchmarks/results/<machine-tag>/extra/<name>.json; then render the README tables from
# the result files (benchmarks/summarize.py --write).
#
#   benchmarks/run.sh                                   # every suite
#   SUITES="matmul transfer" benchmarks/run.sh          # a subset
#   EXTRAS=all benchmarks/run.sh                        # every suite and the extra benchmarks
#   SUITES= EXTRAS="pipeline_cpu ddp_cpu" benchmarks/run.sh   # extra benchmarks only
#   THREADS=4 benchmarks/run.sh                         # torch threads per process (default 1)
#   QUICK=1 TAG=my-box benchmarks/run.sh                # tiny sizes, another directory name
#   SIZE=medium benchmarks/run.sh                       # parallel/split-sweep at 64x64 (CPU: minutes)
#
# Each run is written to a temporary directory first. A run during which the CPU was
# contended (runnable tasks waiting for a CPU more than 20% of the time, from
# /proc/pressure/cpu) is not copied into benchmarks/results unless FORCE=1: its files are
# left in the temporary directory, named at the end, and the script exits 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg
TAG=${TAG:-$("$PY" -c 'from torchgpu.bench.report import machine_tag; print(machine_tag())')}
SUITES=${SUITES-"matmul transfer parallel split-sweep dp-ddp checkpointing accumulation overhead"}
EXTRAS=${EXTRAS:-}
if [ "$EXTRAS" = all ]; then EXTRAS="ddp_cpu pipeline_cpu demo_vs_script sharded_save_cpu"; fi
flags=()
if [ -n "${QUICK:-}" ]; then flags+=(--quick); fi
if [ -n "${THREADS:-}" ]; then flags+=(--threads "$THREADS"); fi
dest="benchmarks/results/$TAG"
stage=$(mktemp -d "${TMPDIR:-/tmp}/torchgpu-bench.XXXXXX")
refused=()

noisy() {  # exit 0 when the JSON file $1 says its run was contended
    "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1])).get("noisy") else 1)' "$1"
}

keep() {  # keep STAGED DEST JSON: move a finished run into benchmarks/results
    if noisy "$3" && [ "${FORCE:-}" != 1 ]; then
        echo "!! $2 not updated: the CPU was contended during this run (timings unreliable);" \
             "its files are in $1 (FORCE=1 keeps such runs)" >&2
        refused+=("$1")
        return
    fi
    rm -rf "$2"
    mkdir -p "$(dirname "$2")"
    mv "$1" "$2"
}

for suite in $SUITES; do
    echo "== $suite -> $dest/$suite"
    # shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
    sized=()
    case "$suite" in parallel|split-sweep) [ -n "${SIZE:-}" ] && sized=(--size "$SIZE");; esac
    "$PY" -m torchgpu bench "$suite" --out "$stage/$suite" ${flags[@]+"${flags[@]}"} \
        ${sized[@]+"${sized[@]}"} ${BENCH_FLAGS:-}
    keep "$stage/$suite" "$dest/$suite" "$stage/$suite/results.json"
done
for extra in $EXTRAS; do
    echo "== benchmarks/$extra.py -> $dest/extra/$extra.json"
    "$PY" -m torchgpu.bench.extra "benchmarks/$extra.py" "$stage/$extra.json" ${QUICK:+--quick}
    keep "$stage/$extra.json" "$dest/extra/$extra.json" "$stage/$extra.json"
done
"$PY" benchmarks/summarize.py --write
if [ ${#refused[@]} -gt 0 ]; then
    echo "!! ${#refused[@]} run(s) not kept because the CPU was contended: ${refused[*]}" >&2
    exit 1
fi
rmdir "$stage" 2>/dev/null || true
