#!/usr/bin/env bash
# On nvidia-h200: ncu kernel times of one eager proxy backbone forward+backward with the fused
# probability kernel (masked_probs_wgmma.cu) and without (SPARSETRON_MASKED_SCORES=unfused), and
# ncu's full sections for the fused kernel's last (widest) chunk of the first layer.
# Usage: bench/scripts/fused-probs-ncu.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fused-probs-ncu.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin/sparsetron
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0"
times() {  # NAME: every kernel's time, summarized
  # shellcheck disable=SC2086  # the options are words
  timeout 150 scripts/gpu-run.sh ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    $bin bench $r $bb --forward-backward --warmup 0 --iters 1 >"$out/$1.csv" 2>/dev/null ||
    echo "ncu $1 failed"
  python3 tools/bench/ncu_summary.py "$out/$1.csv" >"$out/$1.txt" 2>&1
  rm -f "$out/$1.csv"
  head -25 "$out/$1.txt"
}
times fused
SPARSETRON_MASKED_SCORES=unfused times unfused
# shellcheck disable=SC2086
timeout 150 scripts/gpu-run.sh ncu --clock-control none --set full --kernel-name \
  regex:masked_probs_wgmma --launch-skip 7 --launch-count 1 -f -o "$out/probs" \
  $bin bench $r $bb --forward-backward --warmup 0 --iters 1 >"$out/probs-run.log" 2>&1
echo "ncu full rc=$?"
ncu --import "$out/probs.ncu-rep" --page details >"$out/probs-details.txt" 2>&1
grep -E "Duration|Compute \(SM\) Throughput|L2 Cache Throughput|DRAM Throughput|Registers Per|Achieved Occupancy|Issued Ipc|No Eligible|Tensor" "$out/probs-details.txt" | head -20
