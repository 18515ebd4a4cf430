#!/usr/bin/env bash
# Run every bench suite at full size into benchmarks/results/<machine-tag>/<suite>/, then
# render the README tables from the result files (benchmarks/summarize.py --write).
#   SUITES="matmul transfer" benchmarks/run.sh     # a subset
#   TAG=my-box BENCH_FLAGS=--quick benchmarks/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export MPLBACKEND=Agg
TAG=${TAG:-$("$PY" -c 'from torchgpu.bench.report import machine_tag; print(machine_tag())')}
SUITES=${SUITES:-"matmul transfer parallel split-sweep dp-ddp checkpointing accumulation overhead"}
for suite in $SUITES; do
    echo "== $suite -> benchmarks/results/$TAG/$suite"
    # shellcheck disable=SC2086  # BENCH_FLAGS is a list of flags
    "$PY" -m torchgpu bench "$suite" --out "benchmarks/results/$TAG/$suite" ${BENCH_FLAGS:-}
done
"$PY" benchmarks/summarize.py --write
