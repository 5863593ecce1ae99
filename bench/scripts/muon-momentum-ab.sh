#!/usr/bin/env bash
# On nvidia-h200: the batched Muon test (the momentum updated in the gather, the apply's decay and
# bf16 copy), the GPU suite, the full proxy step (graph, 2 warm-up + 4 timed) with Muon's momentum
# updated in the gather (the engine) against SPARSETRON_MUON_MOMENTUM=separate (its own pass
# first), interleaved, two rounds; then ncu kernel times of one eager step.
# Usage: bench/scripts/muon-momentum-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: muon-momentum-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
timeout 90 scripts/gpu-run.sh $bin/test_gpu --gtest_filter='CudaMuon.*' >"$out/first.log" 2>&1
echo "first tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|error|normalized error" "$out/first.log" | head -20
bench/scripts/gpu-suite.sh "$out"
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
run() {  # name, SPARSETRON_MUON_MOMENTUM value, bench options
  local name=$1 value=$2
  shift 2
  # shellcheck disable=SC2068  # the options are words
  SPARSETRON_MUON_MOMENTUM=$value timeout 100 scripts/gpu-run.sh $bin/sparsetron bench $r $@ \
    --variants graph --json "$out/runs.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph " "$out/$name.log" | tail -1 | sed "s/^/$name /"
}
for round in 1 2; do
  run step-fused "" --warmup 2 --iters 4
  run step-separate separate --warmup 2 --iters 4
done
# NCU_KERNELS (a regex) limits the kernel times to those kernels.
timeout 250 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  ${NCU_KERNELS:+--kernel-name "regex:$NCU_KERNELS"} scripts/gpu-run.sh $bin/sparsetron bench $r --warmup 0 --iters 1 --variants eager \
  >"$out/ncu.csv" 2>"$out/ncu.err"
echo "ncu rc=$?"
python3 tools/bench/ncu_summary.py "$out/ncu.csv" 70 >"$out/profile.txt" 2>&1
grep -E "total|apply_kernel|gather_kernel|momentum|inverse_norms|scale_kernel|f32_to_bf16" \
  "$out/profile.txt"
