#!/usr/bin/env bash
# On nvidia-h200: ncu kernel times of one eager proxy step (the recipe: Gram-form Newton-Schulz),
# then the full step (graph, 2 warm-up + 4 timed) in bf16 and with fp8_recipe: blockwise, both
# with the Gram form (issue 7 targets 2 and 3).
# Usage: bench/scripts/gram-profile-fp8.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: gram-profile-fp8.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
# shellcheck disable=SC2086  # the options are words
timeout 190 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  scripts/gpu-run.sh $bin/sparsetron bench $r --warmup 0 --iters 1 --variants eager \
  >"$out/ncu.csv" 2>"$out/ncu.err"
echo "ncu rc=$?"
python3 tools/bench/ncu_summary.py "$out/ncu.csv" 70 >"$out/profile.txt" 2>&1
head -30 "$out/profile.txt"
. bench/scripts/bench-run.sh
run step-bf16 --warmup 2 --iters 4
run step-fp8 --set fp8_recipe=blockwise --warmup 2 --iters 4
