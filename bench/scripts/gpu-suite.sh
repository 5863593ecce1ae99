#!/usr/bin/env bash
# On the GPU machine: the whole GPU test suite into OUT_DIR/gpu.log, its summary on stdout.
# Usage: bench/scripts/gpu-suite.sh OUT_DIR
set -uo pipefail
out=${1:?usage: gpu-suite.sh OUT_DIR}
mkdir -p "$out"
# The limit leaves room for the hang watchdog: a test past 150 s prints every thread's stack
# and aborts (tests/gpu/hang_watchdog.cpp).
timeout 400 scripts/gpu-run.sh build/default/bin/test_gpu >"$out/gpu.log" 2>&1
echo "gpu suite rc=$?"
grep -E "^\[  (PASSED|FAILED) |FAILED  \]|SKIPPED \] [0-9]" "$out/gpu.log"
