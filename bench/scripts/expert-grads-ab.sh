#!/usr/bin/env bash
# On nvidia-h200: the GPU suite, the perf harness's grouped GEMM lines (the weight gradient
# written and added to, dense cuBLASLt beside), then the routed experts' weight gradients written
# by the grouped GEMM on the step's first write (the engine) against SPARSETRON_EXPERT_GRADS=added
# (zeroed, then added to): the proxy backbone's forward+backward (graph) ABAB and the full proxy
# step (graph, 2 warm-up + 4 timed) AB, one process each; HuggingFace's backbone last (HF=0
# skips it). JSON lines: OUT/backbone.jsonl, OUT/runs.jsonl (the steps), OUT/hf.jsonl.
# LONG=1 instead: the suite, the backbone ABBA with BB_ITERS timed graph replays (default 30),
# then ncu's times of the grouped GEMM kernels over one eager forward+backward each way.
# Usage: bench/scripts/expert-grads-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: expert-grads-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
. bench/scripts/backbone-ab-run.sh  # the suite (stops on a sparse MHA failure), backbone NAME
if grep -q "FAILED.*GroupedGemm" "$out/gpu.log"; then
  echo "grouped GEMM tests failed: no benches"
  exit 1
fi
if [ "${LONG:-0}" = 1 ]; then
  export BB_ITERS=${BB_ITERS:-30}
  backbone bb-written
  SPARSETRON_EXPERT_GRADS=added backbone bb-added
  SPARSETRON_EXPERT_GRADS=added backbone bb-added2
  backbone bb-written2
  ncu_times written grouped_gemm_ws
  SPARSETRON_EXPERT_GRADS=added ncu_times added grouped_gemm_ws
  exit 0
fi
SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES='weight grad' timeout 90 scripts/gpu-run.sh \
  $bin/test_gpu --gtest_filter='CudaOpsPerf.GroupedExpertGemm' 2>&1 |
  grep "^\[perf\]" >"$out/perf.txt"
cat "$out/perf.txt"
backbone bb-written
SPARSETRON_EXPERT_GRADS=added backbone bb-added
backbone bb-written2
SPARSETRON_EXPERT_GRADS=added backbone bb-added2
. bench/scripts/bench-run.sh  # run NAME OPTIONS...
run step-written --warmup 2 --iters 4
SPARSETRON_EXPERT_GRADS=added run step-added --warmup 2 --iters 4
if [ "${HF:-1}" = 1 ]; then
  timeout 120 python3 tools/bench/hf_glm_moe_dsa.py --warmup 3 --iters 10 >"$out/hf.jsonl" \
    2>"$out/hf.err" || echo "HF baseline failed"
  tail -1 "$out/hf.jsonl"
fi
