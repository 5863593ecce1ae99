#!/usr/bin/env bash
# On nvidia-h200: the GPU suite, then the proxy backbone's forward+backward (graph) with the fused
# probability kernel of the masked expanded forward (masked_probs_wgmma.cu) and without
# (SPARSETRON_MASKED_SCORES=unfused), ABAB, and HuggingFace's backbone in the same call (HF=0
# skips it); NCU=1 adds ncu's times of the probability kernels over one eager forward+backward
# (NCU_VARIANTS: which of "fused unfused"); ROUNDS=1 runs one A B pair instead of two.
# Usage: bench/scripts/fused-probs-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fused-probs-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
. bench/scripts/backbone-ab-run.sh  # the suite (stops on a sparse MHA failure), backbone NAME
backbone bb-fused
SPARSETRON_MASKED_SCORES=unfused backbone bb-unfused
if [ "${ROUNDS:-2}" = 2 ]; then
  backbone bb-fused2
  SPARSETRON_MASKED_SCORES=unfused backbone bb-unfused2
fi
if [ "${NCU:-0}" = 1 ]; then
  for v in ${NCU_VARIANTS:-fused unfused}; do
    if [ "$v" = unfused ]; then
      SPARSETRON_MASKED_SCORES=unfused ncu_times "$v" masked_probs
    else
      ncu_times "$v" masked_probs
    fi
  done
fi
if [ "${HF:-1}" = 1 ]; then
  timeout 120 python3 tools/bench/hf_glm_moe_dsa.py --warmup 3 --iters 10 >"$out/hf.jsonl" \
    2>"$out/hf.err" || echo "HF baseline failed"
  tail -1 "$out/hf.jsonl"
fi
