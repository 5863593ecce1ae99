#!/usr/bin/env bash
# On nvidia-h200: the new op tests first (the expanded masked attention, the grouped GEMM's pairs
# across experts), the GPU suite, the perf harness's grouped GEMM lines, then the proxy backbone's
# forward+backward (graph, 3 warm-up + 20 timed) with the DSA attention in the expanded form (the
# engine) against SPARSETRON_MLA_FORM=absorbed, interleaved, one process each, two rounds;
# HuggingFace's backbone in the same call, and the engine's full proxy step.
# Usage: bench/scripts/expanded-attention-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: expanded-attention-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
timeout 90 scripts/gpu-run.sh $bin/test_gpu --gtest_filter='SparseMha*:*GroupedGemm*' \
  >"$out/first.log" 2>&1
echo "first tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|error" "$out/first.log" | head -20
bench/scripts/gpu-suite.sh "$out"
SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES=gemm timeout 90 scripts/gpu-run.sh \
  $bin/test_gpu --gtest_filter='CudaOpsPerf.GroupedExpertGemm' 2>&1 |
  grep "^\[perf\]" >"$out/perf-grouped.txt"
grep -E "engine|dense" "$out/perf-grouped.txt" | head -40
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward --warmup 3 --iters 20"
run() {  # name, SPARSETRON_MLA_FORM value, bench options
  local name=$1 value=$2
  shift 2
  # shellcheck disable=SC2068  # the options are words
  SPARSETRON_MLA_FORM=$value timeout 120 scripts/gpu-run.sh $bin/sparsetron bench $r $@ \
    --variants graph --json "$out/${name%%-*}.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph " "$out/$name.log" | tail -1 | sed "s/^/$name /"
}
for round in 1 2; do
  run backbone-expanded "" $bb
  run backbone-absorbed absorbed $bb
done
timeout 150 python3 tools/bench/hf_glm_moe_dsa.py --warmup 3 --iters 10 >"$out/hf.jsonl" \
  2>"$out/hf.err" || echo "HF baseline failed"
tail -1 "$out/hf.jsonl"
run step-expanded "" --warmup 2 --iters 4
