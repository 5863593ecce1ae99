#!/usr/bin/env bash
# On nvidia-h200, one call: the CP / pipeline / recompute-block / wgmma sparse MQA GPU tests,
# then the proxy's backbone at 4K and at 128K (every recompute module) with recompute_block_rows
# 16384 and 32768, and the full step (MTP x7 e2e TV, indexer loss, Muon) at 4K and at 32K (every
# module recomputed, expert_fc1 offloaded, as call 16); graph, 2 warm-up + 3 timed. Logs and
# bench.jsonl into $OUT. Usage: OUT=dir long-context-128k-blocks.sh COMMIT
set -uo pipefail
out=${OUT:?} c=${1:?commit}
. "$(dirname "$0")/long-context-lib.sh"
ALL='recompute_modules=[core_attn,mla_up_proj,layernorm,moe_act,mlp,shared_experts]'
timeout 120 scripts/gpu-run.sh build/default/bin/test_gpu \
  --gtest_filter='CudaContextParallel.*:CudaPipeline.*:CudaModel.RecomputeBlocks*:SparseMqaWgmma.*' \
  >"$out/test_gpu.log" 2>&1
echo "test_gpu rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$out/test_gpu.log"
BENCH_TIMEOUT=100 bench_run bb4k 3 --set seq_length=4096 $BACKBONE
BENCH_TIMEOUT=150 bench_run bb128k 3 --set seq_length=131072 $BACKBONE \
  --set recompute_granularity=selective --set "$ALL"
BENCH_TIMEOUT=150 bench_run bb128k_b32k 3 --set seq_length=131072 $BACKBONE \
  --set recompute_granularity=selective --set "$ALL" --set recompute_block_rows=32768
BENCH_TIMEOUT=100 bench_run step4k 3 --set seq_length=4096
BENCH_TIMEOUT=150 bench_run step32k 3 --set seq_length=32768 --set recompute_granularity=selective \
  --set "$ALL" --set fine_grained_activation_offloading=true --set 'offload_modules=[expert_fc1]'
