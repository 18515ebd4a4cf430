#!/usr/bin/env bash
# The GPU check (benchmarks/gpu/kit.py) with nothing installed: PYTHONPATH=src python3.
#
#   benchmarks/gpu.sh                      # PART=all: tests, bench and train (<= 9 min, 1 GPU)
#   PART=bench benchmarks/gpu.sh           # one part per device call: tests|bench|train|multi
#   DRY_RUN=1 benchmarks/gpu.sh            # print every command, run nothing
#   OUT=/some/dir benchmarks/gpu.sh        # also pack the results into one .tar.gz there
#   benchmarks/gpu.sh --only train-fp32    # extra flags go to kit.py (see --help)
set -euo pipefail
cd "$(dirname "$0")/.."
flags=(--part "${PART:-all}")
if [ -n "${DRY_RUN:-}" ] && [ "${DRY_RUN}" != 0 ]; then flags+=(--dry-run); fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" benchmarks/gpu/kit.py \
    "${flags[@]}" "$@"
