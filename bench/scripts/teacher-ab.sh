#!/usr/bin/env bash
# On nvidia-h200: the GPU suite, then the full proxy step (graph, 2 warm-up + 4 timed) with the
# sparse indexer loss's teacher from the masked attention's probabilities (the engine) against
# SPARSETRON_INDEXER_TEACHER=recompute (the teacher recomputed from Q' / K', those layers in the
# absorbed form: the previous commit's behaviour), interleaved, two rounds; then, with PROFILE=1,
# ncu kernel times of one backbone forward+backward.
# Usage: bench/scripts/teacher-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: teacher-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bench/scripts/gpu-suite.sh "$out"
bin=build/default/bin
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
run() {  # name, SPARSETRON_INDEXER_TEACHER value, bench options
  local name=$1 value=$2
  shift 2
  # shellcheck disable=SC2068  # the options are words
  SPARSETRON_INDEXER_TEACHER=$value timeout 120 scripts/gpu-run.sh $bin/sparsetron bench $r $@ \
    --variants graph --json "$out/${name%%-*}.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph " "$out/$name.log" | tail -1 | sed "s/^/$name /"
}
for round in 1 2; do
  run step-engine "" --warmup 2 --iters 4
  run step-recompute recompute --warmup 2 --iters 4
done
if [ "${PROFILE:-0}" = 1 ]; then
  bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0"
  timeout 150 scripts/gpu-run.sh ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    $bin/sparsetron bench $r $bb --forward-backward --warmup 0 --iters 1 >"$out/ncu.csv" \
    2>/dev/null || echo "ncu failed"
  python3 tools/bench/ncu_summary.py "$out/ncu.csv" >"$out/profile.txt" 2>&1
  head -30 "$out/profile.txt"
fi
