#!/usr/bin/env bash
# On nvidia-h200-x2: the FP8-vs-bf16 loss-curve pair (docs/perf/README.md) in one call, bf16 on
# GPU 0 and fp8_recipe: blockwise on GPU 1 at the same time (loss-curve-pair-x2.sh; each run is
# one-GPU training). Leaves bf16.* and fp8.* (metrics.jsonl, log tail) in OUT_DIR; then on the
# development machine:
#   python3 tools/bench/compare_loss_curves.py OUT/bf16.metrics.jsonl OUT/fp8.metrics.jsonl
# Usage: bench/scripts/fp8-loss-curves-x2.sh OUT_DIR [STEPS]
set -uo pipefail
out=${1:?usage: fp8-loss-curves-x2.sh OUT_DIR [STEPS]}
steps=${2:-200}
"$(dirname "$0")/loss-curve-pair-x2.sh" "$out" "$steps" "" "--set fp8_recipe=blockwise"
for f in metrics.jsonl log.tail; do
  mv "$out/a.$f" "$out/bf16.$f" 2>/dev/null
  mv "$out/b.$f" "$out/fp8.$f" 2>/dev/null
done
