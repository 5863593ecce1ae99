#!/usr/bin/env bash
# On nvidia-h200, one call: test_gpu, then the proxy's backbone at 4K and 32K (recompute
# mla_up_proj, layernorm, moe_act) and the full step at 4K and 16K (recompute core_attn +
# mla_up_proj, offload expert_fc1 + fused_group_mlp; the indexer loss in 4096-row blocks against one
# block) as graph replays. Logs and bench.jsonl into $OUT. Usage: OUT=dir long-context-streamed-loss.sh COMMIT
set -uo pipefail
out=${OUT:?} c=${1:?commit}
. "$(dirname "$0")/long-context-lib.sh"
BENCH_TIMEOUT=280
run_test_gpu
grep -E "\[model long document" "$out/test_gpu.log"
bench_run bb4k 4 --set seq_length=4096 $BACKBONE
bench_run bb32k 4 --set seq_length=32768 $BACKBONE --set recompute_granularity=selective --set 'recompute_modules=[mla_up_proj,layernorm,moe_act]'
bench_run step4k 4 --set seq_length=4096
bench_run step16k 4 --set seq_length=16384 --set recompute_granularity=selective --set 'recompute_modules=[core_attn,mla_up_proj]' --set fine_grained_activation_offloading=true --set 'offload_modules=[expert_fc1,fused_group_mlp]' --variant blocks= --variant whole="--set dsa_indexer_query_block=16384" --rounds 1
