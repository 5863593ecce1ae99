#!/usr/bin/env bash
# On nvidia-h200: the proxy backbone's forward+backward (mtp_num_layers=0, frozen indexer) eager
# vs graph, HuggingFace glm_moe_dsa's at the same shape, the full proxy step (graph) and, with
# PROFILE=1, an ncu kernel-time breakdown of one backbone forward+backward.
# Usage: bench/scripts/backbone-vs-hf.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: backbone-vs-hf.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin/sparsetron
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0"
scripts/gpu-run.sh $bin bench $r $bb --forward-backward --variants eager,graph --warmup 3 \
  --iters 10 --json "$out/backbone.jsonl" >"$out/backbone.log" 2>&1 || echo "backbone bench failed"
python3 tools/bench/hf_glm_moe_dsa.py --warmup 3 --iters 10 >"$out/hf.jsonl" 2>"$out/hf.err" ||
  echo "HF baseline failed"
scripts/gpu-run.sh $bin bench $r --variants graph --warmup 2 --iters 4 \
  --json "$out/step.jsonl" >"$out/step.log" 2>&1 || echo "step bench failed"
if [ "${PROFILE:-0}" = 1 ]; then
  scripts/gpu-run.sh ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    $bin bench $r $bb --forward-backward --warmup 0 --iters 1 >"$out/ncu.csv" 2>/dev/null ||
    echo "ncu failed"
  python3 tools/bench/ncu_summary.py "$out/ncu.csv" >"$out/profile.txt" 2>&1
  head -30 "$out/profile.txt"
fi
grep -h "median" "$out/backbone.log" "$out/step.log"
tail -1 "$out/hf.jsonl"
