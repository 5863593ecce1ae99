#!/usr/bin/env bash
# On nvidia-h200: the Muon tests (batched Newton-Schulz in both forms, the CUDA engine against the
# CPU with each form), the GPU suite, then the full proxy step (graph, 2 warm-up + 4 timed) with
# the standard Newton-Schulz against the Gram form (muon_ns_method, set explicitly), interleaved, two rounds;
# the forward+backward alone (the optimizer's share by difference); with CURVE_STEPS, proxy
# training runs of that many steps with each form (the loss curves, compared afterwards with
# tools/bench/compare_loss_curves.py); with NCU=1, ncu kernel times of one eager Gram-form step.
# ROUNDS (default 2): A/B rounds.
# Usage: [ROUNDS=n] [CURVE_STEPS=n] [NCU=1] bench/scripts/gram-ns-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: gram-ns-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
timeout 150 scripts/gpu-run.sh $bin/test_gpu --gtest_filter='CudaMuon*:CudaTraining.Muon*' \
  >"$out/first.log" 2>&1
echo "first tests rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|rror|harness\] (Gram|batched)|training muon" \
  "$out/first.log" | head -40
bench/scripts/gpu-suite.sh "$out"
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
. bench/scripts/bench-run.sh
for round in $(seq "${ROUNDS:-2}"); do
  run step-standard --set muon_ns_method=standard --warmup 2 --iters 4
  run step-gram --set muon_ns_method=gram --warmup 2 --iters 4
done
run fwdbwd --forward-backward --warmup 2 --iters 4
if [ -n "${CURVE_STEPS:-}" ]; then
  for method in standard gram; do
    timeout 250 scripts/gpu-run.sh $bin/sparsetron train --recipe recipes/glm5.2-proxy-h200.yaml \
      --device cuda --no-save --out "$out/curve-$method" --set train_iters="$CURVE_STEPS" \
      --set cuda_graph_impl=full_iteration --set muon_ns_method=$method >"$out/curve-$method.log" 2>&1
    echo "curve $method rc=$?"
    tail -2 "$out/curve-$method.log"
  done
fi
if [ "${NCU:-0}" = 1 ]; then
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    scripts/gpu-run.sh $bin/sparsetron bench $r --set muon_ns_method=gram --warmup 0 --iters 1 \
    --variants eager >"$out/ncu.csv" 2>"$out/ncu.err"
  echo "ncu rc=$?"
  python3 tools/bench/ncu_summary.py "$out/ncu.csv" 70 >"$out/profile.txt" 2>&1
  head -40 "$out/profile.txt"
fi
