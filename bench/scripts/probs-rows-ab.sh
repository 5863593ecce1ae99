#!/usr/bin/env bash
# On nvidia-h200: the changed ops' tests first (vector RMSNorm / SwiGLU / MoE row kernels / expanded
# kv gradient, per-token RoPE angles, the warp-per-row probability kernel through every masked
# attention test), the GPU suite, then the proxy backbone's forward+backward (graph, 3 warm-up +
# 20 timed) with the warp-per-row probability kernel (the engine) against
# SPARSETRON_MASKED_PROBS=block, interleaved, two rounds; HuggingFace's backbone in the same call;
# the engine's full proxy step; ncu kernel times of one backbone forward+backward.
# Usage: bench/scripts/probs-rows-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: probs-rows-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
timeout 90 scripts/gpu-run.sh $bin/test_gpu --gtest_filter='CudaOps.RmsNorm*:CudaOps.SwiGlu:CudaOps.Rope*:CudaOps.MlaExpanded*:CudaOps.RouterPermute*:CudaOps.MoeBackward*:*Masked*:SparseMha*' \
  >"$out/first.log" 2>&1
echo "first tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|error" "$out/first.log" | head -20
bench/scripts/gpu-suite.sh "$out"
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward --warmup 3 --iters 20"
run() {  # name, SPARSETRON_MASKED_PROBS value, bench options
  local name=$1 value=$2
  shift 2
  # shellcheck disable=SC2068  # the options are words
  SPARSETRON_MASKED_PROBS=$value timeout 120 scripts/gpu-run.sh $bin/sparsetron bench $r $@ \
    --variants graph --json "$out/${name%%-*}.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph " "$out/$name.log" | tail -1 | sed "s/^/$name /"
}
for round in 1 2; do
  run backbone-rows "" $bb
  run backbone-block block $bb
done
timeout 150 python3 tools/bench/hf_glm_moe_dsa.py --warmup 3 --iters 10 >"$out/hf.jsonl" \
  2>"$out/hf.err" || echo "HF baseline failed"
tail -1 "$out/hf.jsonl"
run step-rows "" --warmup 2 --iters 4
bbp="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0"
timeout 150 scripts/gpu-run.sh ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  $bin/sparsetron bench $r $bbp --forward-backward --warmup 0 --iters 1 >"$out/ncu.csv" \
  2>/dev/null || echo "ncu failed"
python3 tools/bench/ncu_summary.py "$out/ncu.csv" 60 >"$out/profile.txt" 2>&1
head -40 "$out/profile.txt"
