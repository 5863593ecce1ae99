#!/usr/bin/env bash
# On nvidia-h200: the kernel-time breakdown (ncu --clock-control none, gpu__time_duration) of one
# eager forward+backward of the proxy backbone (mtp_num_layers=0, dsa_indexer_loss_coeff=0) at each
# length, summed per kernel by tools/bench/ncu_summary.py into OUT/ncu-backbone-<tokens>.txt.
# EXTRA_<tokens> adds options at one length (e.g. the recompute modules that make 32K fit).
# Usage: bench/scripts/ncu-backbone-lengths.sh OUT COMMIT "4096 16384 32768"
set -uo pipefail
out=${1:?usage: ncu-backbone-lengths.sh OUT COMMIT LENGTHS} commit=${2:?} lengths=${3:?}
mkdir -p "$out"
for t in $lengths; do
  extra_var="EXTRA_$t"
  # shellcheck disable=SC2086  # the options are words
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --log-file "$out/ncu-backbone-$t.csv" scripts/gpu-run.sh build/default/bin/sparsetron bench \
    --recipe recipes/glm5.2-proxy-h200.yaml --commit "$commit" --set seq_length="$t" \
    --set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward ${!extra_var:-} \
    --variants eager --warmup 0 --iters 1 >"$out/ncu-backbone-$t.log" 2>&1
  echo "ncu backbone $t rc=$?"
  python3 tools/bench/ncu_summary.py "$out/ncu-backbone-$t.csv" 40 >"$out/ncu-backbone-$t.txt"
  head -20 "$out/ncu-backbone-$t.txt"
done
