#!/usr/bin/env bash
# On nvidia-h200: a session's closing call after kernel changes: the GPU suite, the perf harness's
# engine grouped GEMM lines and the dense GEMM of the same shape (SPARSETRON_OPS_PERF_LINES=gemm),
# then bench/scripts/backbone-vs-hf.sh (backbone eager / graph, HuggingFace, full step).
# Usage: bench/scripts/suite-then-backbone.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: suite-then-backbone.sh OUT_DIR COMMIT}
commit=${2:-unknown}
bench/scripts/gpu-suite.sh "$out"
bin=build/default/bin
SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES=gemm timeout 60 scripts/gpu-run.sh \
  $bin/test_gpu --gtest_filter='CudaOpsPerf.GroupedExpertGemm' 2>&1 | grep "^\[perf\]" |
  tee "$out/perf-grouped.txt"
timeout 300 bench/scripts/backbone-vs-hf.sh "$out/backbone" "$commit"
