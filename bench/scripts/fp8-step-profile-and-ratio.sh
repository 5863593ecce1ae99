#!/usr/bin/env bash
# On nvidia-h200: ncu's kernel times over one eager FP8 proxy step (fp8_recipe: blockwise;
# includes the one-time bf16 refresh of the weights that keep a copy), summarized by
# tools/bench/ncu_summary.py into OUT/ncu-fp8-step.txt, then the FP8 step against the bf16 step,
# ABAB (graph, 2 warm-up + 4 timed). JSON lines: OUT/runs.jsonl.
# Usage: bench/scripts/fp8-step-profile-and-ratio.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fp8-step-profile-and-ratio.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
# shellcheck disable=SC2086  # the options are words
timeout 240 scripts/gpu-run.sh ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  $bin/sparsetron bench $r --set fp8_recipe=blockwise --warmup 0 --iters 1 --variants eager \
  >/tmp/ncu-fp8-step.csv 2>/dev/null || echo "ncu failed"
python3 tools/bench/ncu_summary.py /tmp/ncu-fp8-step.csv 100 >"$out/ncu-fp8-step.txt" 2>&1
head -3 "$out/ncu-fp8-step.txt"
. bench/scripts/bench-run.sh  # run NAME OPTIONS...
run step-fp8 --set fp8_recipe=blockwise --warmup 2 --iters 4
run step-bf16 --warmup 2 --iters 4
run step-fp8-2 --set fp8_recipe=blockwise --warmup 2 --iters 4
run step-bf16-2 --warmup 2 --iters 4
