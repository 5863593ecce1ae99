#!/usr/bin/env bash
# On nvidia-h200: the GPU suite, PyTorch's cuDNN SDPA at the proxy's attention shape with a
# DSA-like mask (cudnn-sdpa-probe.py), ncu kernel times of one eager proxy step, and the step as a
# replayed graph with the 16-byte mirror and with the scalar one (SPARSETRON_NS_SCALAR_MIRROR=1).
# Usage: bench/scripts/muon-kernels-and-sdpa-probe.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: muon-kernels-and-sdpa-probe.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bench/scripts/gpu-suite.sh "$out"
grep -h "\[harness\] Gram\|\[harness\] blocked" "$out/gpu.log"
timeout 120 python3 bench/scripts/cudnn-sdpa-probe.py --json "$out/sdpa.json" 2>&1 | tail -8
bin=build/default/bin
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
# shellcheck disable=SC2086  # the options are words
timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
  scripts/gpu-run.sh $bin/sparsetron bench $r --warmup 0 --iters 1 --variants eager \
  >"$out/ncu.csv" 2>"$out/ncu.err"
echo "ncu rc=$?"
python3 tools/bench/ncu_summary.py "$out/ncu.csv" 70 >"$out/profile.txt" 2>&1
grep -E "total|mirror|identity|scale_kernel|norm_partials|gather_kernel|apply_kernel" "$out/profile.txt"
. bench/scripts/bench-run.sh
run step-vec-mirror --warmup 2 --iters 4
SPARSETRON_NS_SCALAR_MIRROR=1 run step-scalar-mirror --warmup 2 --iters 4
