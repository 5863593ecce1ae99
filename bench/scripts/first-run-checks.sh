#!/usr/bin/env bash
# On nvidia-h200: a session's first call after code that no GPU has run: the GPU suite, then the
# harness's flash sparse MQA lines (forward with and without the teacher, backward) at 4K and
# 32K, and the 32K indexer pair.
# Usage: bench/scripts/first-run-checks.sh OUT_DIR
set -uo pipefail
out=${1:?usage: first-run-checks.sh OUT_DIR}
mkdir -p "$out"
bin=build/default/bin
timeout 120 scripts/gpu-run.sh $bin/test_gpu >"$out/gpu.log" 2>&1
echo "gpu suite rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" "$out/gpu.log"
SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES=flash timeout 200 scripts/gpu-run.sh \
  $bin/test_gpu --gtest_filter='CudaOpsPerf.SparseMqa*' 2>&1 | grep "^\[perf\]" |
  tee "$out/perf-flash.txt"
SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES=32K timeout 120 scripts/gpu-run.sh \
  $bin/test_gpu --gtest_filter='CudaOpsPerf.IndexerAt32K' 2>&1 | grep "^\[perf\]" |
  tee "$out/perf-indexer.txt"
