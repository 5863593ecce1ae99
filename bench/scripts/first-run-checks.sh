#!/usr/bin/env bash
# On nvidia-h200: the first run of the kernels written without a GPU on 2026-11-30 (night), in one
# call: the GPU suite (it includes SparseMqaWgmma.* and the streaming top-k in
# IndexerWgmma.TopkEveryRowLengthClassMatchesCpuRule), the harness lines for the flash-style sparse
# MQA forward and the streaming top-k at 4K and 32K, and the proxy backbone (graph) with the
# flash forward in place of the masked one against the default, in one process each.
# Usage: bench/scripts/first-run-checks.sh OUT_DIR
set -uo pipefail
out=${1:?usage: first-run-checks.sh OUT_DIR}
mkdir -p "$out"
bin=build/default/bin
timeout 120 scripts/gpu-run.sh $bin/test_gpu >"$out/gpu.log" 2>&1
echo "gpu suite rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$out/gpu.log"
SPARSETRON_OPS_PERF=1 timeout 240 scripts/gpu-run.sh $bin/test_gpu \
  --gtest_filter='CudaOpsPerf.SparseMqaAndIndexerAtTopk2048:CudaOpsPerf.SparseMqaAt32K:CudaOpsPerf.IndexerAt32K' \
  >"$out/perf.log" 2>&1
grep -E "^\[perf\]" "$out/perf.log"
r="--recipe recipes/glm5.2-proxy-h200.yaml --set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0"
r="$r --set dsa_saved_probs_max_mib=0 --forward-backward --variants graph --warmup 3 --iters 10"
for v in default wgmma default wgmma; do
  if [ $v = wgmma ]; then export SPARSETRON_SPARSE_MQA=wgmma; else unset SPARSETRON_SPARSE_MQA; fi
  # shellcheck disable=SC2086  # the options are words
  timeout 120 scripts/gpu-run.sh $bin/sparsetron bench $r 2>&1 | grep -E "graph " | sed "s/^/$v /"
done | tee "$out/backbone.txt"
