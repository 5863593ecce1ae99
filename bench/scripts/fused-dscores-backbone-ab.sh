#!/usr/bin/env bash
# On nvidia-h200: the GPU suite, then the proxy backbone's forward+backward (graph) with the fused
# dS kernel (masked_dscores_wgmma.cu) and without (SPARSETRON_MASKED_DSCORES=unfused), ABAB; with
# STEP=1 also the full proxy step both ways and HuggingFace's backbone.
# Usage: bench/scripts/fused-dscores-backbone-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: fused-dscores-backbone-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
. bench/scripts/backbone-ab-run.sh  # the suite (stops on a sparse MHA failure), backbone NAME
backbone bb-fused
SPARSETRON_MASKED_DSCORES=unfused backbone bb-unfused
backbone bb-fused2
SPARSETRON_MASKED_DSCORES=unfused backbone bb-unfused2
if [ "${STEP:-0}" = 1 ]; then
  timeout 120 python3 tools/bench/hf_glm_moe_dsa.py --warmup 3 --iters 10 >"$out/hf.jsonl" \
    2>"$out/hf.err" || echo "HF baseline failed"
  tail -1 "$out/hf.jsonl"
  . bench/scripts/bench-run.sh
  RUN_TIMEOUT=100 run step-fused --warmup 2 --iters 4
  SPARSETRON_MASKED_DSCORES=unfused RUN_TIMEOUT=100 run step-unfused --warmup 2 --iters 4
fi
