#!/usr/bin/env bash
# On nvidia-h200: the flash-style wgmma sparse MQA backward's first run: its tests and the sparse
# MQA op tests; the harness's flash lines at 4K and 32K; and only if the tests pass, the proxy
# backbone (graph) with probabilities kept vs recomputed behind the flash forward and backward
# (SPARSETRON_SPARSE_MQA_BWD=flash), and ncu of the backward kernel at 4K.
# Usage: bench/scripts/flash-backward-first-run.sh OUT_DIR
set -uo pipefail
out=${1:?usage: flash-backward-first-run.sh OUT_DIR}
mkdir -p "$out"
bin=build/default/bin
timeout 90 scripts/gpu-run.sh $bin/test_gpu --gtest_filter='SparseMqaWgmma*:CudaOps.SparseMqa*' \
  >"$out/tests.log" 2>&1
rc=$?
echo "tests rc=$rc"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|normalized error .*(dq|dkv)" "$out/tests.log" | head -20
SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES=flash timeout 150 scripts/gpu-run.sh \
  $bin/test_gpu --gtest_filter='CudaOpsPerf.SparseMqa*' 2>&1 | grep "^\[perf\]" | tee "$out/perf.txt"
[ $rc = 0 ] || exit 0
r="--recipe recipes/glm5.2-proxy-h200.yaml --set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0"
r="$r --forward-backward --variants graph --warmup 3 --iters 10"
for v in kept flash kept flash; do
  extra="" bwd=""
  [ $v = flash ] && extra="--set dsa_saved_probs_max_mib=0" && bwd=flash
  # shellcheck disable=SC2086  # the options are words
  SPARSETRON_SPARSE_MQA_BWD=$bwd timeout 120 scripts/gpu-run.sh $bin/sparsetron bench $r $extra \
    2>&1 | grep -E "graph " | sed "s/^/$v /"
done | tee "$out/backbone.txt"
export PATH=$PATH:/usr/local/cuda/bin
SPARSETRON_OPS_PERF_LINES=flash bench/scripts/ncu-kernels.sh "$out" bwd4k sparse_mqa_bwd_wgmma CudaOpsPerf.SparseMqaAndIndexerAtTopk2048
(cd "$out" && tar czf bwd4k.tgz bwd4k* && rm -f bwd4k-* bwd4k.ncu-rep)
