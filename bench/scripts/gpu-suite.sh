#!/usr/bin/env bash
# On the GPU machine: the whole GPU test suite into OUT_DIR/gpu.log, its summary on stdout.
# Usage: bench/scripts/gpu-suite.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu-suite.sh OUT_DIR}
mkdir -p "$out"
timeout 120 scripts/gpu-run.sh build/default/bin/test_gpu >"$out/gpu.log" 2>&1
echo "gpu suite rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" "$out/gpu.log"
