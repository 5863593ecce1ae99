#!/usr/bin/env bash
# README command (1): set up, build, and train the built-in tiny recipe on the bundled corpus on
# CPU, ending with a saved checkpoint in runs/tiny. Extra arguments go to `sparsetron train`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/setup.sh
cmake --preset default >/dev/null
cmake --build --preset default --target sparsetron
exec build/default/bin/sparsetron train --out runs/tiny "$@"
