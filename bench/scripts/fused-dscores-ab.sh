#!/usr/bin/env bash
# On nvidia-h200: the GPU suite, the fused dS kernel of the masked expanded backward against the
# unfused dP GEMM + dS kernel on the proxy backbone (ABAB), HuggingFace's backbone and the full
# proxy step both ways: fused-dscores-backbone-ab.sh with STEP=1 (the 9120e7c record's run, which
# also printed the Gram harness lines of the suite).
# Usage: bench/scripts/fused-dscores-ab.sh OUT_DIR COMMIT
STEP=1 exec "$(dirname "$0")/fused-dscores-backbone-ab.sh" "$@"
