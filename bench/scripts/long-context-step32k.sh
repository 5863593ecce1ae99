#!/usr/bin/env bash
# On nvidia-h200, two calls for the proxy's full step (MTP x7 e2e TV, indexer loss, Muon) at 32K
# tokens per micro-batch: recompute every module (core_attn, mla_up_proj, layernorm, moe_act, mlp,
# shared_experts), offload the routed experts' gate / up rows (expert_fc1).
#   OUT=dir long-context-step32k.sh bench COMMIT  test_gpu, then the full step at 4K and at 32K
#                                                 (graph, 2 warm-up + 3 timed) into bench.jsonl
#   OUT=dir long-context-step32k.sh train         30 training steps at 32K on the bundled corpus
set -uo pipefail
out=${OUT:?} what=${1:?bench or train}
c=${2:-}
. "$(dirname "$0")/long-context-lib.sh"
K32=(--set seq_length=32768 --set recompute_granularity=selective
     --set 'recompute_modules=[core_attn,mla_up_proj,layernorm,moe_act,mlp,shared_experts]'
     --set fine_grained_activation_offloading=true --set 'offload_modules=[expert_fc1]')
if [ "$what" = bench ]; then
  : "${c:?commit}"
  run_test_gpu
  bench_run step4k 3 --set seq_length=4096
  bench_run step32k 3 "${K32[@]}"
else
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
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
