#!/usr/bin/env bash
# On nvidia-h200-x2: the proxy recipe trained for a few steps on one GPU and on two GPUs with
# expert parallelism (EP2 x DP2) and with dynamic context parallelism, each two-GPU run against a
# one-GPU run of the same step data, printing the per-step losses side by side.
# Documents over max_seqlen_per_dp_cp_rank (default 2048) run on CP groups of both GPUs.
# Usage (from the repository root, after building): bench/scripts/proxy-parallel-vs-1gpu.sh OUT
set -uo pipefail
out=${1:?usage: proxy-parallel-vs-1gpu.sh OUT_DIR}
steps=${STEPS:-3}
bin=build/default/bin/sparsetron
recipe=recipes/glm5.2-proxy-h200.yaml
common="--recipe $recipe --set train_iters=$steps --set global_batch_size=2"
# Dynamic CP takes per-token loss (calculate_per_token_loss, as Megatron requires), so the indexer
# loss does not depend on the grouping: both runs of that pair set it.
per_token="--set calculate_per_token_loss=true"
dyn="--set context_parallel_size=2 --set dynamic_context_parallel=true \
 --set sequence_packing_scheduler=default_dynamic_cp --set max_seqlen_per_dp_cp_rank=${DCP_MAX:-2048}"
one() {  # tag, extra args
  mkdir -p "$out/$1"
  scripts/gpu-run.sh $bin train --device cuda --quiet --no-save --out "$out/$1" $common $2 \
    >"$out/$1/rank0.log" 2>&1 || { echo "$1 failed"; tail -n 20 "$out/$1/rank0.log"; }
}
two() {  # tag, port, extra args
  mkdir -p "$out/$1"
  LOG_DIR="$out/$1" MASTER_PORT=$2 scripts/launch-local.sh 2 scripts/gpu-run.sh $bin train \
    --device cuda --quiet --no-save --out "$out/$1" $common --set world_size=2 $3 >/dev/null ||
    { echo "$1 failed"; tail -n 20 "$out/$1/rank0.log" "$out/$1/rank1.log"; }
}
one 1gpu ""
two ep2 29611 "--set expert_model_parallel_size=2"
one 1gpu-per-token "$per_token"
two dcp 29612 "$per_token $dyn"
python3 - "$out" <<'P'
import json, sys
out = sys.argv[1]
def m(tag):
    try: return [json.loads(l) for l in open(f"{out}/{tag}/metrics.jsonl") if l.strip()]
    except OSError: return []
res = {}
for ref, run in (("1gpu", "ep2"), ("1gpu-per-token", "dcp")):
    a, b = m(ref), m(run)
    rows = []
    for x, y in zip(a, b):
        r = {"step": x["step"]}
        for k in ("lm_loss", "mtp_loss", "indexer_loss", "grad_norm", "step_ms"):
            r[k] = [y.get(k), x.get(k)]
        r["lm_rel_diff"] = abs(y["lm_loss"] - x["lm_loss"]) / x["lm_loss"]
        r["grad_norm_rel_diff"] = abs(y["grad_norm"] - x["grad_norm"]) / x["grad_norm"]
        r["tokens_equal"] = x["tokens"] == y["tokens"] and x["targets"] == y["targets"]
        if "dynamic_cp_groups" in y: r["dynamic_cp_groups"] = y["dynamic_cp_groups"]
        rows.append(r)
        print(run, "vs", ref, json.dumps(r))
    res[run] = rows
json.dump(res, open(f"{out}/compare.json", "w"), indent=1)
P
