#!/usr/bin/env bash
# On nvidia-h200: the GPU suite, then ncu's times of the fused probability kernel
# (masked_probs_wgmma.cu) over one eager proxy backbone forward+backward with its single-
# instruction 2^x and four-chain row reductions (the engine's) and with
# SPARSETRON_MASKED_PROBS_EXP=accurate (exp2f, one chain: the form before), then the backbone's
# forward+backward (graph) both ways, ABAB.
# Usage: bench/scripts/probs-exp-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: probs-exp-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
. bench/scripts/backbone-ab-run.sh  # the suite (stops on a sparse MHA failure), backbone NAME
for v in fast accurate; do
  [ "$v" = accurate ] && export SPARSETRON_MASKED_PROBS_EXP=accurate
  # shellcheck disable=SC2086
  timeout 120 scripts/gpu-run.sh ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --kernel-name regex:masked_probs_wgmma $bin/sparsetron bench $r $bb --forward-backward \
    --warmup 0 --iters 1 >"$out/ncu-$v.csv" 2>/dev/null || echo "ncu $v failed"
  python3 tools/bench/ncu_summary.py "$out/ncu-$v.csv" 2>&1 | head -3 | sed "s/^/ncu $v /"
done
unset SPARSETRON_MASKED_PROBS_EXP
backbone bb-fast
SPARSETRON_MASKED_PROBS_EXP=accurate backbone bb-accurate
backbone bb-fast2
SPARSETRON_MASKED_PROBS_EXP=accurate backbone bb-accurate2
