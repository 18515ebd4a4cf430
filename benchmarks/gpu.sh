#!/usr/bin/env bash
# The GPU check (benchmarks/gpu/kit.py) with nothing installed: PYTHONPATH=src python3.
#
#   benchmarks/gpu.sh                      # PART=default: the figures known least first
#                                          # (GPU tests, GPT-2 loop vs raw, H2D, ResNet-50
#                                          # bf16, memory estimate, batch search, OOM
#                                          # back-off), <= 8 min (480 s) on one GPU
#   PART=rest benchmarks/gpu.sh            # every other one-GPU step, <= 570 s
#   PART=bench benchmarks/gpu.sh           # one part per device call: tests|bench|lm|train|
#                                          # multi (each fills <= 570 s of a 600 s call)
#   PART=all benchmarks/gpu.sh             # every one-GPU step by priority, <= 9 min
#   DRY_RUN=1 benchmarks/gpu.sh            # print every command and its limit, run nothing
#   OUT=/some/dir benchmarks/gpu.sh        # pack the results into one .tar.gz there (after
#                                          # every step, so a cut-off call still returns them)
#   GIT_REV=abc1234 benchmarks/gpu.sh      # the revision, where the tree has no .git
#   benchmarks/gpu.sh --only train-fp32    # extra flags go to kit.py (see --help)
set -euo pipefail
cd "$(dirname "$0")/.."
flags=(--part "${PART:-default}")
if [ -n "${DRY_RUN:-}" ] && [ "${DRY_RUN}" != 0 ]; then flags+=(--dry-run); fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" benchmarks/gpu/kit.py \
    "${flags[@]}" "$@"
