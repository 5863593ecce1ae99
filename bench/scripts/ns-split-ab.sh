#!/usr/bin/env bash
# On nvidia-h200: the Muon tests first, the GPU suite, then the full proxy step (graph, 2 warm-up +
# 4 timed) with Newton-Schulz out of place (the engine) against SPARSETRON_NS_COPIES=1 (two copies
# per iteration), interleaved, two rounds; the step split (forward+backward only; AdamW in place
# of Muon); FP8 blockwise's full step against this call's bf16 ones.
# Usage: bench/scripts/ns-split-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: ns-split-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
timeout 120 scripts/gpu-run.sh $bin/test_gpu --gtest_filter='CudaMuon*:CudaTraining.Muon*' \
  >"$out/first.log" 2>&1
echo "first tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|error|harness\] blocked" "$out/first.log" | head -20
bench/scripts/gpu-suite.sh "$out"
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
run() {  # name, SPARSETRON_NS_COPIES value, bench options
  local name=$1 value=$2
  shift 2
  # shellcheck disable=SC2068  # the options are words
  SPARSETRON_NS_COPIES=$value timeout 100 scripts/gpu-run.sh $bin/sparsetron bench $r $@ \
    --variants graph --json "$out/runs.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph " "$out/$name.log" | tail -1 | sed "s/^/$name /"
}
for round in 1 2; do
  run step-engine "" --warmup 2 --iters 4
  run step-copies 1 --warmup 2 --iters 4
done
run fwdbwd "" --forward-backward --warmup 2 --iters 4
run adam "" --set optimizer=adam --warmup 2 --iters 4
run fp8 "" --set fp8_recipe=blockwise --warmup 2 --iters 4
