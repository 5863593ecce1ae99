#!/usr/bin/env bash
# On nvidia-h200: the routed experts' FP8 grouped GEMM. The GPU suite (stops when an FP8 or
# grouped GEMM test failed), the perf harness's FP8 grouped lines (both consumer forms, the bf16
# grouped GEMM and cuBLASLt's dense FP8 beside), then under fp8_recipe: blockwise the proxy
# backbone's forward+backward (graph) with the experts in FP8 (the engine) against
# SPARSETRON_FP8_EXPERTS=bf16, ABAB, and the bf16 backbone; then the full proxy step (graph, 2
# warm-up + 4 timed) the same three ways. JSON lines: OUT/backbone.jsonl, OUT/runs.jsonl.
# FORMS=1 instead, after the perf lines: the FP8 backbone with SPARSETRON_FP8_GROUPED=overlap and
# =serial (the kernel's two consumer forms).
# Usage: bench/scripts/fp8-experts-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fp8-experts-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
. bench/scripts/backbone-ab-run.sh  # the suite, backbone NAME
if grep -q "FAILED.*\(Fp8\|GroupedGemm\)" "$out/gpu.log"; then
  echo "FP8 or grouped GEMM tests failed: no benches"
  exit 1
fi
SPARSETRON_OPS_PERF=1 timeout 120 scripts/gpu-run.sh $bin/test_gpu \
  --gtest_filter='CudaOpsPerf.GroupedExpertGemmFp8' 2>&1 | grep "^\[perf\]" >"$out/perf.txt"
cat "$out/perf.txt"
bb16=$bb
bb="$bb16 --set fp8_recipe=blockwise"
if [ "${FORMS:-0}" = 1 ]; then
  SPARSETRON_FP8_GROUPED=overlap backbone bb-fp8-overlap
  SPARSETRON_FP8_GROUPED=serial backbone bb-fp8-serial
  exit 0
fi
backbone bb-fp8-experts
SPARSETRON_FP8_EXPERTS=bf16 backbone bb-bf16-experts
backbone bb-fp8-experts2
SPARSETRON_FP8_EXPERTS=bf16 backbone bb-bf16-experts2
bb=$bb16
backbone bb-bf16
. bench/scripts/bench-run.sh  # run NAME OPTIONS...
run step-fp8-experts --set fp8_recipe=blockwise --warmup 2 --iters 4
SPARSETRON_FP8_EXPERTS=bf16 run step-bf16-experts --set fp8_recipe=blockwise --warmup 2 --iters 4
run step-bf16 --warmup 2 --iters 4
