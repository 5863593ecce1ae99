#!/usr/bin/env bash
# On nvidia-h200: the changed ops' tests (indexer scores backward in both forms, gradient norm over
# many partials, both softmax kernels), the GPU suite, then the full proxy step (graph, 2 warm-up
# + 4 timed) with the indexer scores backward as GEMMs (the engine) against
# SPARSETRON_INDEXER_BWD=atomic (one kernel per query row with atomics), interleaved, two rounds.
# Usage: bench/scripts/indexer-bwd-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: indexer-bwd-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
timeout 90 scripts/gpu-run.sh $bin/test_gpu \
  --gtest_filter='CudaOps.Indexer*:CudaOps.GradNorm*:CudaOps.Softmax*:CudaOps.MtpTv*' \
  >"$out/first.log" 2>&1
echo "first tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|error|indexer dk|softmax" "$out/first.log" | head -20
bench/scripts/gpu-suite.sh "$out"
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
run() {  # name, SPARSETRON_INDEXER_BWD value, bench options
  local name=$1 value=$2
  shift 2
  # shellcheck disable=SC2068  # the options are words
  SPARSETRON_INDEXER_BWD=$value timeout 100 scripts/gpu-run.sh $bin/sparsetron bench $r $@ \
    --variants graph --json "$out/runs.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph " "$out/$name.log" | tail -1 | sed "s/^/$name /"
}
for round in 1 2; do
  run step-gemm "" --warmup 2 --iters 4
  run step-atomic atomic --warmup 2 --iters 4
done
