#!/usr/bin/env bash
# On nvidia-h200: a grouped GEMM kernel choice against the engine's: the grouped GEMM tests, the
# perf harness's grouped GEMM lines (every configuration, each kind, uniform and skewed routing,
# the dense cuBLASLt GEMM of the same shape), then the proxy backbone forward+backward (graph)
# with the engine's choice and with SPARSETRON_GROUPED_GEMM=CHOICE (waits, tma, pair or
# stores), interleaved, one process each.
# Usage: bench/scripts/grouped-gemm-ab.sh OUT_DIR COMMIT CHOICE
set -uo pipefail
out=${1:?usage: grouped-gemm-ab.sh OUT_DIR COMMIT CHOICE}
commit=${2:-unknown}
choice=${3:?usage: grouped-gemm-ab.sh OUT_DIR COMMIT CHOICE}
mkdir -p "$out"
bin=build/default/bin
timeout 60 scripts/gpu-run.sh $bin/test_gpu --gtest_filter='*GroupedGemm*' >"$out/tests.log" 2>&1
rc=$?
echo "grouped gemm tests rc=$rc"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" "$out/tests.log"
[ $rc -eq 0 ] || exit 1  # a kernel that fails or hangs here is not timed
SPARSETRON_OPS_PERF=1 timeout 120 scripts/gpu-run.sh $bin/test_gpu \
  --gtest_filter='CudaOpsPerf.GroupedExpertGemm' 2>&1 | grep "^\[perf\]" | tee "$out/perf.txt"
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward --warmup 3 --iters 10"
run() {  # name, SPARSETRON_GROUPED_GEMM value
  # shellcheck disable=SC2086  # the options are words
  SPARSETRON_GROUPED_GEMM=$2 timeout 90 scripts/gpu-run.sh $bin/sparsetron bench $r $bb \
    --variants graph --json "$out/$1.jsonl" >>"$out/$1.log" 2>&1 || echo "$1 failed"
  grep -h "graph " "$out/$1.log" | tail -1 | sed "s/^/$1 /"
}
for round in 1 2; do
  run backbone-engine ""
  run "backbone-$choice" "$choice"
done
exit 0  # the tests passed; the timings above say the rest
