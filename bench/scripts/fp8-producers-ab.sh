#!/usr/bin/env bash
# On nvidia-h200: the routed experts' FP8 inputs written by the kernels that produce them, and the
# faster 1x128 and weight quantizers. The GPU suite (stops when an FP8 test failed), the producer
# perf lines, the quantizer lines with the current kernels and with SPARSETRON_FP8_QUANTIZE=v1's,
# then the full proxy step (graph, 2 warm-up + 4 timed) under fp8_recipe: blockwise, ABAB: the
# current form against the one before (SPARSETRON_FP8_QUANTIZE=v1 SPARSETRON_FP8_PRODUCERS=
# separate), then the bf16 step. JSON lines: OUT/runs.jsonl.
# Usage: bench/scripts/fp8-producers-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fp8-producers-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
STOP_ON=Fp8 . bench/scripts/backbone-ab-run.sh  # the suite; $bin, $r
perf() {  # GTEST_FILTER: the perf lines of those tests
  SPARSETRON_OPS_PERF=1 timeout 120 scripts/gpu-run.sh $bin/test_gpu --gtest_filter="$1" 2>&1 |
    grep "^\[perf\]"
}
perf 'CudaOpsPerf.MoeProducersFp8' | tee "$out/perf.txt"
SPARSETRON_OPS_PERF_LINES=quantize perf 'CudaOpsPerf.GroupedExpertGemmFp8' | sed 's/^/now /' |
  tee -a "$out/perf.txt"
SPARSETRON_FP8_QUANTIZE=v1 SPARSETRON_OPS_PERF_LINES=quantize \
  perf 'CudaOpsPerf.GroupedExpertGemmFp8' | sed 's/^/v1 /' | tee -a "$out/perf.txt"
. bench/scripts/bench-run.sh  # run NAME OPTIONS...
fp8="--set fp8_recipe=blockwise --warmup 2 --iters 4"
before() { SPARSETRON_FP8_QUANTIZE=v1 SPARSETRON_FP8_PRODUCERS=separate run "$@"; }
run step-fp8 $fp8
before step-fp8-before $fp8
run step-fp8-2 $fp8
before step-fp8-before-2 $fp8
run step-bf16 --warmup 2 --iters 4
