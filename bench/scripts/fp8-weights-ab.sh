#!/usr/bin/env bash
# On nvidia-h200: the FP8 weights' per-step costs. The GPU suite (stops when an FP8 test failed),
# the expert weight quantizer's lines (16 launches vs one), then the full proxy step (graph,
# 2 warm-up + 4 timed) under fp8_recipe: blockwise, ABAB: the current form (one quantizer launch
# per expert set, no bf16 copies of the FP8 weights) against the one before
# (SPARSETRON_FP8_EXPERT_QUANTIZE=per_expert SPARSETRON_FP8_BF16_COPIES=keep), then each change
# alone. JSON lines: OUT/runs.jsonl.
# Usage: bench/scripts/fp8-weights-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fp8-weights-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
STOP_ON=Fp8 . bench/scripts/backbone-ab-run.sh  # the suite; $bin, $r
SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES=quantize timeout 120 scripts/gpu-run.sh \
  $bin/test_gpu --gtest_filter='CudaOpsPerf.GroupedExpertGemmFp8' 2>&1 | grep "^\[perf\]" |
  tee "$out/perf.txt"
. bench/scripts/bench-run.sh  # run NAME OPTIONS...
fp8="--set fp8_recipe=blockwise --warmup 2 --iters 4"
before() { SPARSETRON_FP8_EXPERT_QUANTIZE=per_expert SPARSETRON_FP8_BF16_COPIES=keep run "$@"; }
run step-fp8 $fp8
before step-fp8-before $fp8
run step-fp8-2 $fp8
before step-fp8-before-2 $fp8
SPARSETRON_FP8_BF16_COPIES=keep run step-fp8-copies-kept $fp8
SPARSETRON_FP8_EXPERT_QUANTIZE=per_expert run step-fp8-per-expert-quantize $fp8
