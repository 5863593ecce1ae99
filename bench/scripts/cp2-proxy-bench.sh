#!/usr/bin/env bash
# On nvidia-h200-x2: the proxy's forward+backward on one GPU and with CP2 (both GPUs sharing the
# micro-batch), then the CP2 full step eager vs graph (ABBA) with the distributed optimizer.
# Usage: bench/scripts/cp2-proxy-bench.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: cp2-proxy-bench.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin/sparsetron
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
scripts/gpu-run.sh $bin bench $r --forward-backward --warmup 2 --iters 4 \
  --json "$out/fb-1gpu.jsonl" >"$out/fb-1gpu.log" 2>&1 || echo "1-GPU fb failed"
mkdir -p "$out/cp2-fb" "$out/cp2-step"
LOG_DIR="$out/cp2-fb" MASTER_PORT=29631 scripts/launch-local.sh 2 scripts/gpu-run.sh $bin bench $r \
  --set world_size=2 --set context_parallel_size=2 --forward-backward --warmup 2 --iters 4 \
  --json "$out/fb-cp2.jsonl" >/dev/null 2>&1 || echo "CP2 fb failed"
LOG_DIR="$out/cp2-step" MASTER_PORT=29632 scripts/launch-local.sh 2 scripts/gpu-run.sh $bin bench $r \
  --set world_size=2 --set context_parallel_size=2 --set use_distributed_optimizer=true \
  --variants eager,graph --warmup 2 --iters 4 --json "$out/step-cp2.jsonl" >/dev/null 2>&1 ||
  echo "CP2 step failed"
grep -h "median\|step\.\|fb\.\|forward" "$out/fb-1gpu.log" "$out/cp2-fb/rank0.log" \
  "$out/cp2-step/rank0.log" | grep -v "^\[graph\]"
