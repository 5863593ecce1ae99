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
ncu_times fast masked_probs_wgmma
SPARSETRON_MASKED_PROBS_EXP=accurate ncu_times accurate masked_probs_wgmma
backbone bb-fast
SPARSETRON_MASKED_PROBS_EXP=accurate backbone bb-accurate
backbone bb-fast2
SPARSETRON_MASKED_PROBS_EXP=accurate backbone bb-accurate2
