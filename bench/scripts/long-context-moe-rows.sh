#!/usr/bin/env bash
# On nvidia-h200, one call: test_gpu, then the proxy's backbone at 4K and 32K (recompute
# mla_up_proj only, which fits once the MoE backward keeps no expert output rows) and the full step
# at 4K and 16K (recompute core_attn + mla_up_proj, offload expert_fc1 + fused_group_mlp) as graph
# replays. Logs and bench.jsonl into $OUT. Usage: OUT=dir long-context-moe-rows.sh COMMIT
set -uo pipefail
out=${OUT:?} c=${1:?commit}
. "$(dirname "$0")/long-context-lib.sh"
BENCH_TIMEOUT=150
run_test_gpu
grep -E "\[bench\]|moe gate" "$out/test_gpu.log" | head
bench_run bb4k 4 --set seq_length=4096 $BACKBONE
bench_run bb32k 4 --set seq_length=32768 $BACKBONE --set recompute_granularity=selective --set 'recompute_modules=[mla_up_proj]'
bench_run step4k 4 --set seq_length=4096
bench_run step16k 4 --set seq_length=16384 --set recompute_granularity=selective --set 'recompute_modules=[core_attn,mla_up_proj]' --set fine_grained_activation_offloading=true --set 'offload_modules=[expert_fc1,fused_group_mlp]'
