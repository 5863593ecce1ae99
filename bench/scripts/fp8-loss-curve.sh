#!/usr/bin/env bash
# On nvidia-h200: one precision's proxy training run for the FP8-vs-bf16 loss-curve comparison
# (docs/perf/README.md): the proxy recipe, STEPS steps, replayed graphs, no checkpoint (the 64 GiB
# disk). Run once per precision (each fits one call), then on the development machine:
#   python3 tools/bench/compare_loss_curves.py BF16/metrics.jsonl FP8/metrics.jsonl --json ...
# Usage: bench/scripts/fp8-loss-curve.sh OUT_DIR bf16|fp8 [STEPS]
set -euo pipefail
out=${1:?usage: fp8-loss-curve.sh OUT_DIR bf16|fp8 [STEPS]}
precision=${2:?bf16 or fp8}
steps=${3:-200}
mkdir -p "$out"
extra=()
[ "$precision" = fp8 ] && extra=(--set fp8_recipe=blockwise)
scripts/gpu-run.sh build/default/bin/sparsetron train --recipe recipes/glm5.2-proxy-h200.yaml \
  --device cuda --no-save --out "$out/$precision" --set train_iters="$steps" \
  --set cuda_graph_impl=full_iteration "${extra[@]}" >"$out/$precision.log" 2>&1
tail -3 "$out/$precision.log"
