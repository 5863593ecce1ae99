#!/usr/bin/env bash
# On nvidia-h200, one call: test_gpu, then the proxy's backbone (forward + backward, graph, 2
# warm-up + 3 timed) at 4K, at 32K keeping every activation, at 64K recomputing every module
# (core_attn, mla_up_proj, layernorm, moe_act, mlp, shared_experts), and the full step at 4K.
# Logs and bench.jsonl into $OUT. Usage: OUT=dir long-context-64k.sh COMMIT
set -uo pipefail
out=${OUT:?} c=${1:?commit}
R=recipes/glm5.2-proxy-h200.yaml
B="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward"
ALL='recompute_modules=[core_attn,mla_up_proj,layernorm,moe_act,mlp,shared_experts]'
run() { local name=$1; shift
  timeout 150 scripts/gpu-run.sh build/default/bin/sparsetron bench --recipe $R --commit "$c" \
    --variants graph --warmup 2 --iters 3 --json "$out/bench.jsonl" "$@" >"$out/$name.log" 2>&1 \
    || { echo "$name failed"; tail -3 "$out/$name.log"; }
  grep -A1 "^variant" "$out/$name.log" | tail -1; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
timeout 240 scripts/gpu-run.sh build/default/bin/test_gpu >"$out/test_gpu.log" 2>&1
echo "test_gpu rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$out/test_gpu.log" | head -20
run bb4k --set seq_length=4096 $B
run bb32k --set seq_length=32768 $B
run bb64k --set seq_length=65536 $B --set recompute_granularity=selective --set "$ALL"
run step4k --set seq_length=4096
