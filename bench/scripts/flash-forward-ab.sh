#!/usr/bin/env bash
# On nvidia-h200: the proxy backbone forward+backward (graph) and the full proxy step (graph) with
# the sparse attention's probabilities kept (the recipe's dsa_saved_probs_max_mib: masked forward
# and backward), recomputed behind the flash forward (dsa_saved_probs_max_mib=0), and recomputed
# behind the masked forward (the same with SPARSETRON_SPARSE_MQA=noflash), interleaved, one
# process each; then HuggingFace glm_moe_dsa at the backbone's shape, and 4 training steps of the
# proxy behind each forward (the losses must agree to bf16 rounding).
# Usage: bench/scripts/flash-forward-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: flash-forward-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin/sparsetron
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward --warmup 3 --iters 10"
run() {  # name, bench options, SPARSETRON_SPARSE_MQA value
  # shellcheck disable=SC2086  # the options are words
  SPARSETRON_SPARSE_MQA=$3 timeout 150 scripts/gpu-run.sh $bin bench $r $2 --variants graph \
    --json "$out/$1.jsonl" >>"$out/$1.log" 2>&1 || echo "$1 failed"
  grep -h "graph " "$out/$1.log" | tail -1 | sed "s/^/$1 /"
}
for round in 1 2; do
  run backbone-kept "$bb" ""
  run backbone-flash "$bb --set dsa_saved_probs_max_mib=0" ""
  run backbone-noflash "$bb --set dsa_saved_probs_max_mib=0" noflash
done
run step-kept "--warmup 2 --iters 4" ""
run step-flash "--warmup 2 --iters 4 --set dsa_saved_probs_max_mib=0" ""
python3 tools/bench/hf_glm_moe_dsa.py --warmup 3 --iters 10 >"$out/hf.jsonl" 2>"$out/hf.err" ||
  echo "HF baseline failed"
tail -1 "$out/hf.jsonl"
for mqa in "" noflash; do
  SPARSETRON_SPARSE_MQA=$mqa timeout 150 scripts/gpu-run.sh $bin train \
    --recipe recipes/glm5.2-proxy-h200.yaml --device cuda --no-save --out "$out/train-$mqa" \
    --set train_iters=4 --set dsa_saved_probs_max_mib=0 >"$out/train-${mqa:-flash}.log" 2>&1
  grep -h "lm_loss\|mtp_loss" "$out/train-${mqa:-flash}.log" | sed "s/^/train ${mqa:-flash}: /"
done
