#!/usr/bin/env bash
# On nvidia-h200, one call: test_gpu, then the proxy's backbone (forward + backward, graph, 2
# warm-up + 3 timed) at 4K, at 128K and 64K recomputing every module (core_attn, mla_up_proj,
# layernorm, moe_act, mlp, shared_experts; the recomputed modules in blocks of
# recompute_block_rows), and at 32K keeping every activation. Logs and bench.jsonl into $OUT.
# Usage: OUT=dir long-context-128k.sh COMMIT
set -uo pipefail
out=${OUT:?} c=${1:?commit}
. "$(dirname "$0")/long-context-lib.sh"
ALL='recompute_modules=[core_attn,mla_up_proj,layernorm,moe_act,mlp,shared_experts]'
TEST_GPU_TIMEOUT=300 run_test_gpu
BENCH_TIMEOUT=150 bench_run bb4k 3 --set seq_length=4096 $BACKBONE
BENCH_TIMEOUT=200 bench_run bb128k 3 --set seq_length=131072 $BACKBONE \
  --set recompute_granularity=selective --set "$ALL"
BENCH_TIMEOUT=120 bench_run bb64k 3 --set seq_length=65536 $BACKBONE \
  --set recompute_granularity=selective --set "$ALL"
BENCH_TIMEOUT=100 bench_run bb32k 3 --set seq_length=32768 $BACKBONE
