#!/usr/bin/env bash
# On nvidia-h200: the changed pieces' tests (the e2e TV kernels in both widths, the e2e_tv model
# parity in both target forms, batched Muon with the decay and the bf16 copy in its apply), the
# GPU suite, then the full proxy step (graph, 2 warm-up + 4 timed) with one block of target rows
# shared by the seven depths (the engine) against SPARSETRON_TV_TARGETS=per_depth (a head GEMM
# and a softmax per depth), interleaved, two rounds.
# Usage: bench/scripts/tv-targets-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: tv-targets-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
timeout 120 scripts/gpu-run.sh $bin/test_gpu \
  --gtest_filter='CudaOps.MtpTv*:CudaOps.Softmax*:CudaMuon.*:CudaModel.E2eTv*' \
  >"$out/first.log" 2>&1
echo "first tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|error|mtp\[|normalized error" "$out/first.log" | head -30
bench/scripts/gpu-suite.sh "$out"
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
run() {  # name, SPARSETRON_TV_TARGETS value, bench options
  local name=$1 value=$2
  shift 2
  # shellcheck disable=SC2068  # the options are words
  SPARSETRON_TV_TARGETS=$value timeout 100 scripts/gpu-run.sh $bin/sparsetron bench $r $@ \
    --variants graph --json "$out/runs.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph \|memory" "$out/$name.log" | tail -2 | sed "s/^/$name /"
}
for round in 1 2; do
  run step-shared "" --warmup 2 --iters 4
  run step-per-depth per_depth --warmup 2 --iters 4
done
