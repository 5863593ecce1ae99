#!/usr/bin/env bash
# On nvidia-h200: Muon's normalization from sums of squares written by the gather. The GPU suite
# (stops when a Muon test failed), CudaOpsPerf.MuonGatherAndNormalize, then the full bf16 proxy
# step (graph, 2 warm-up + 4 timed) ABAB: the current form against SPARSETRON_MUON_NORMS=separate.
# JSON lines: OUT/runs.jsonl.
# Usage: bench/scripts/muon-norms-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: muon-norms-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
STOP_ON=Muon . bench/scripts/backbone-ab-run.sh  # the suite; $bin, $r
SPARSETRON_OPS_PERF=1 timeout 120 scripts/gpu-run.sh $bin/test_gpu \
  --gtest_filter='CudaOpsPerf.MuonGatherAndNormalize' 2>&1 | grep "^\[perf\]" | tee "$out/perf.txt"
. bench/scripts/bench-run.sh  # run NAME OPTIONS...
run step-bf16 --warmup 2 --iters 4
SPARSETRON_MUON_NORMS=separate run step-bf16-separate-norms --warmup 2 --iters 4
run step-bf16-2 --warmup 2 --iters 4
SPARSETRON_MUON_NORMS=separate run step-bf16-separate-norms-2 --warmup 2 --iters 4
