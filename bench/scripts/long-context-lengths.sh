#!/usr/bin/env bash
# On nvidia-h200, one call: test_gpu, then the backbone length targets of issue 36 against the
# same call's 4K figure (graph, 2 warm-up + 3 timed): 4K, 32K and 16K keeping every activation,
# 64K recomputing every module; with HF=1 HuggingFace's backbone at 16K; with STEP=1 the full
# step (MTP x7 e2e TV, indexer loss, Muon) at 4K and at 32K (every module recomputed, expert_fc1
# offloaded). Logs and bench.jsonl into $OUT. Usage: OUT=dir [HF=1] [STEP=1] long-context-lengths.sh COMMIT
set -uo pipefail
out=${OUT:?} c=${1:?commit}
. "$(dirname "$0")/long-context-lib.sh"
ALL='recompute_modules=[core_attn,mla_up_proj,layernorm,moe_act,mlp,shared_experts]'
run_test_gpu
bench_run bb4k 3 --set seq_length=4096 $BACKBONE
bench_run bb32k 3 --set seq_length=32768 $BACKBONE
bench_run bb64k 3 --set seq_length=65536 $BACKBONE --set recompute_granularity=selective --set "$ALL"
bench_run bb16k 3 --set seq_length=16384 $BACKBONE
if [ "${HF:-0}" = 1 ]; then  # HuggingFace glm_moe_dsa's backbone at 16K, the same call
  timeout 150 python3 tools/bench/hf_glm_moe_dsa.py --tokens 16384 --warmup 2 --iters 3 \
    >"$out/hf16k.jsonl" 2>"$out/hf16k.err" || { echo "HF 16K failed"; tail -3 "$out/hf16k.err"; }
  tail -1 "$out/hf16k.jsonl"
fi
[ "${STEP:-0}" = 1 ] || exit 0
bench_run step4k 3 --set seq_length=4096
bench_run step32k 3 --set seq_length=32768 --set recompute_granularity=selective --set "$ALL" \
  --set fine_grained_activation_offloading=true --set 'offload_modules=[expert_fc1]'
