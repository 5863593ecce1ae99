#!/usr/bin/env bash
# On nvidia-h200: fp8_recipe blockwise against bf16 on the proxy, one call: the backbone's
# forward+backward (mtp_num_layers=0, frozen indexer) and the full step, graph variant, each
# precision in its own process (two proxy engines do not fit one GPU together).
# Usage: bench/scripts/fp8-vs-bf16.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fp8-vs-bf16.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin/sparsetron
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward"
for p in bf16 fp8; do
  f=""
  [ $p = fp8 ] && f="--set fp8_recipe=blockwise"
  scripts/gpu-run.sh $bin bench $r $bb $f --variants graph --warmup 3 --iters 10 \
    --json "$out/$p.jsonl" >"$out/backbone-$p.log" 2>&1 || echo "backbone $p failed"
  scripts/gpu-run.sh $bin bench $r $f --variants graph --warmup 2 --iters 4 \
    --json "$out/$p.jsonl" >"$out/step-$p.log" 2>&1 || echo "step $p failed"
done
grep -h -A1 "median" "$out"/backbone-*.log "$out"/step-*.log | grep -v "^--"
