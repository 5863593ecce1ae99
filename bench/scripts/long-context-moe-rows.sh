#!/usr/bin/env bash
# On nvidia-h200, one call: test_gpu, then the proxy's backbone at 4K and 32K (recompute
# mla_up_proj only, which fits once the MoE backward keeps no expert output rows) and the full step
# at 4K and 16K (recompute core_attn + mla_up_proj, offload expert_fc1 + fused_group_mlp) as graph
# replays. Logs and bench.jsonl into $OUT. Usage: OUT=dir long-context-moe-rows.sh COMMIT
set -uo pipefail
out=${OUT:?} c=${1:?commit}
R=recipes/glm5.2-proxy-h200.yaml
B="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward"
run() { local name=$1; shift
  timeout 150 scripts/gpu-run.sh build/default/bin/sparsetron bench --recipe $R --commit "$c" \
    --variants graph --warmup 2 --iters 4 --json "$out/bench.jsonl" "$@" >"$out/$name.log" 2>&1 \
    || echo "$name failed"
  grep -E "median|tok/s|ms" "$out/$name.log" | tail -4; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
timeout 240 scripts/gpu-run.sh build/default/bin/test_gpu >"$out/test_gpu.log" 2>&1
echo "test_gpu rc=$?"; grep -E "^\[  (PASSED|FAILED) |tests ran|FAILED  \]" "$out/test_gpu.log" | head -20
grep -E "\[bench\]|moe gate" "$out/test_gpu.log" | head
run bb4k --set seq_length=4096 $B
run bb32k --set seq_length=32768 $B --set recompute_granularity=selective --set 'recompute_modules=[mla_up_proj]'
run step4k --set seq_length=4096
run step16k --set seq_length=16384 --set recompute_granularity=selective --set 'recompute_modules=[core_attn,mla_up_proj]' --set fine_grained_activation_offloading=true --set 'offload_modules=[expert_fc1,fused_group_mlp]'
