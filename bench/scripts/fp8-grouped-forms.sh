#!/usr/bin/env bash
# On nvidia-h200: the FP8 grouped GEMM's two consumer forms (grouped_gemm_fp8.cu). The GPU suite
# (stops when an FP8 or grouped GEMM test failed), the perf harness's FP8 grouped lines (both
# forms, bf16 and cuBLASLt's dense FP8 beside), then the proxy backbone under fp8_recipe:
# blockwise with SPARSETRON_FP8_GROUPED=overlap and =serial (graph).
# Usage: bench/scripts/fp8-grouped-forms.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fp8-grouped-forms.sh OUT_DIR COMMIT}
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
bb="$bb --set fp8_recipe=blockwise"
SPARSETRON_FP8_GROUPED=overlap backbone bb-fp8-overlap
SPARSETRON_FP8_GROUPED=serial backbone bb-fp8-serial
