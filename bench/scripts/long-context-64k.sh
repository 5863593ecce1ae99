#!/usr/bin/env bash
# On nvidia-h200, one call: test_gpu, then the proxy's backbone (forward + backward, graph, 2
# warm-up + 3 timed) at 4K, at 32K keeping every activation, at 64K recomputing every module
# (core_attn, mla_up_proj, layernorm, moe_act, mlp, shared_experts), and the full step at 4K.
# Logs and bench.jsonl into $OUT. Usage: OUT=dir long-context-64k.sh COMMIT
set -uo pipefail
out=${OUT:?} c=${1:?commit}
. "$(dirname "$0")/long-context-lib.sh"
BENCH_TIMEOUT=150
ALL='recompute_modules=[core_attn,mla_up_proj,layernorm,moe_act,mlp,shared_experts]'
run_test_gpu
bench_run bb4k 3 --set seq_length=4096 $BACKBONE
bench_run bb32k 3 --set seq_length=32768 $BACKBONE
bench_run bb64k 3 --set seq_length=65536 $BACKBONE --set recompute_granularity=selective --set "$ALL"
bench_run step4k 3 --set seq_length=4096
