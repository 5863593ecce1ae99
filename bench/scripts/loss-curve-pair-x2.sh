#!/usr/bin/env bash
# On nvidia-h200-x2: two one-GPU proxy training runs at the same time, run A on GPU 0 and run B
# on GPU 1, each with its own extra `--set` options, the same steps (so the same learning-rate
# schedule: train_iters sets it), data and seed. For calibrating a loss-curve bound: e.g. bf16
# against bf16 with TF32 Newton-Schulz (a tiny numerical difference) shows how far two runs drift
# on this noisy curve, the reference the FP8-vs-bf16 gap needs (docs/perf/log/2026-11-30-fp8-training.md).
# Usage: bench/scripts/loss-curve-pair-x2.sh OUT_DIR STEPS "A_SETS" "B_SETS"
#   e.g. ... OUT 200 "" "--set muon_fp32_matmul_prec=high"
# Then: python3 tools/bench/compare_loss_curves.py OUT/a.metrics.jsonl OUT/b.metrics.jsonl
set -uo pipefail
out=${1:?usage: loss-curve-pair-x2.sh OUT_DIR STEPS A_SETS B_SETS}
steps=${2:?steps}
a_sets=${3:-}
b_sets=${4:-}
work=$(mktemp -d)
mkdir -p "$out"
run() {  # GPU NAME SETS
  # shellcheck disable=SC2086  # the sets are words
  CUDA_VISIBLE_DEVICES=$1 scripts/gpu-run.sh build/default/bin/sparsetron train \
    --recipe recipes/glm5.2-proxy-h200.yaml --device cuda --no-save --out "$work/$2" \
    --set train_iters="$steps" --set cuda_graph_impl=full_iteration $3 >"$work/$2.log" 2>&1
}
run 0 a "$a_sets" &
run 1 b "$b_sets" &
wait
for p in a b; do
  cp "$work/$p/metrics.jsonl" "$out/$p.metrics.jsonl" 2>/dev/null || echo "$p: no metrics.jsonl"
  tail -40 "$work/$p.log" >"$out/$p.log.tail"
done
