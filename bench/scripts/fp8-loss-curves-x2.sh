#!/usr/bin/env bash
# On nvidia-h200-x2: the FP8-vs-bf16 loss-curve pair of issue 7 (target 3) in one call, bf16 on
# GPU 0 and fp8_recipe: blockwise on GPU 1 at the same time (each run is one-GPU training; the
# two do not communicate). Copies each run's metrics.jsonl and log tail into OUT_DIR, then on the
# development machine:
#   python3 tools/bench/compare_loss_curves.py OUT/bf16.metrics.jsonl OUT/fp8.metrics.jsonl
# Usage: bench/scripts/fp8-loss-curves-x2.sh OUT_DIR [STEPS]
set -uo pipefail
out=${1:?usage: fp8-loss-curves-x2.sh OUT_DIR [STEPS]}
steps=${2:-200}
work=$(mktemp -d)
mkdir -p "$out"
CUDA_VISIBLE_DEVICES=0 bench/scripts/fp8-loss-curve.sh "$work" bf16 "$steps" &
CUDA_VISIBLE_DEVICES=1 bench/scripts/fp8-loss-curve.sh "$work" fp8 "$steps" &
wait
for p in bf16 fp8; do
  cp "$work/$p/metrics.jsonl" "$out/$p.metrics.jsonl" 2>/dev/null || echo "$p: no metrics.jsonl"
  tail -40 "$work/$p.log" >"$out/$p.log.tail"
done
