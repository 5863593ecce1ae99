#!/usr/bin/env bash
# On nvidia-h200: a session's first call after grouped GEMM code that no GPU has run (as of
# 2026-12-01, eleventh session: the weight gradient's fp32 adds as bulk tensor reduce-adds,
# configuration 8 of grouped_gemm_ws.cu, harness configuration 9, SPARSETRON_GROUPED_GEMM=reduce).
# First bench/scripts/grouped-gemm-ab.sh with SPARSETRON_GROUPED_GEMM=CHOICE (grouped GEMM tests,
# every configuration in the harness, the backbone A/B against the engine's kernel), then the GPU
# suite; if the grouped GEMM tests failed or hung, the suite runs without them, so one kernel's
# hang does not hide the rest.
# Usage: bench/scripts/first-run-checks.sh OUT_DIR COMMIT [CHOICE (default reduce)]
set -uo pipefail
out=${1:?usage: first-run-checks.sh OUT_DIR COMMIT}
commit=${2:-unknown}
choice=${3:-reduce}
mkdir -p "$out"
if bench/scripts/grouped-gemm-ab.sh "$out/grouped" "$commit" "$choice"; then
  bench/scripts/gpu-suite.sh "$out"
else
  echo "grouped GEMM tests failed: the suite without them"
  GTEST_FILTER='-*GroupedGemm*' bench/scripts/gpu-suite.sh "$out"
fi
