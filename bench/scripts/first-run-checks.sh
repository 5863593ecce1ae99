#!/usr/bin/env bash
# On nvidia-h200: a session's first call after grouped GEMM code that no GPU has run: the engine's
# kernel against another form (SPARSETRON_GROUPED_GEMM=CHOICE, by default `stores`, the engine's
# before the weight gradient's bulk tensor reduce-adds).
# First bench/scripts/grouped-gemm-ab.sh with SPARSETRON_GROUPED_GEMM=CHOICE (grouped GEMM tests,
# every configuration in the harness, the backbone A/B against the engine's kernel), then the GPU
# suite; if the grouped GEMM tests failed or hung, the suite runs without them, so one kernel's
# hang does not hide the rest.
# Usage: bench/scripts/first-run-checks.sh OUT_DIR COMMIT [CHOICE (default stores)]
set -uo pipefail
out=${1:?usage: first-run-checks.sh OUT_DIR COMMIT}
commit=${2:-unknown}
choice=${3:-stores}
mkdir -p "$out"
if bench/scripts/grouped-gemm-ab.sh "$out/grouped" "$commit" "$choice"; then
  bench/scripts/gpu-suite.sh "$out"
else
  echo "grouped GEMM tests failed: the suite without them"
  GTEST_FILTER='-*GroupedGemm*' bench/scripts/gpu-suite.sh "$out"
fi
