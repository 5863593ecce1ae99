#!/usr/bin/env bash
# On nvidia-h200, two calls for the proxy's full step (MTP x7 e2e TV, indexer loss, Muon) at 32K
# tokens per micro-batch: recompute every module (core_attn, mla_up_proj, layernorm, moe_act, mlp,
# shared_experts), offload the routed experts' gate / up rows (expert_fc1).
#   OUT=dir long-context-step32k.sh bench COMMIT  test_gpu, then the full step at 4K and at 32K
#                                                 (graph, 2 warm-up + 3 timed) into bench.jsonl
#   OUT=dir long-context-step32k.sh train         30 training steps at 32K on the bundled corpus
set -uo pipefail
out=${OUT:?} what=${1:?bench or train}
R=recipes/glm5.2-proxy-h200.yaml
K32=(--set seq_length=32768 --set recompute_granularity=selective
     --set 'recompute_modules=[core_attn,mla_up_proj,layernorm,moe_act,mlp,shared_experts]'
     --set fine_grained_activation_offloading=true --set 'offload_modules=[expert_fc1]')
run() { local name=$1; shift
  timeout 200 scripts/gpu-run.sh build/default/bin/sparsetron bench --recipe $R --commit "$c" \
    --variants graph --warmup 2 --iters 3 --json "$out/bench.jsonl" "$@" >"$out/$name.log" 2>&1 \
    || echo "$name failed"
  grep -A1 "^variant" "$out/$name.log" | tail -1; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
if [ "$what" = bench ]; then
  c=${2:?commit}
  timeout 240 scripts/gpu-run.sh build/default/bin/test_gpu >"$out/test_gpu.log" 2>&1
  echo "test_gpu rc=$?"; grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$out/test_gpu.log" | head -20
  run step4k --set seq_length=4096
  run step32k "${K32[@]}"
else
  timeout 560 scripts/gpu-run.sh build/default/bin/sparsetron train --device cuda --recipe $R \
    "${K32[@]}" --set train_iters=30 --no-save -q -o "$out/run" >"$out/train.log" 2>&1
  echo "train rc=$?"; tail -5 "$out/train.log"
  python3 - "$out/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"lm_loss"' in l]
for r in rows[:2] + rows[-2:]:
    print(r.get("step"), r.get("lm_loss"), r.get("mtp_loss"), r.get("indexer_loss"), r.get("step_ms"))
PY
fi
