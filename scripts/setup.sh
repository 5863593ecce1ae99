#!/usr/bin/env bash
# Installs the Debian packages Sparsetron builds and tests with (skips apt when all are present),
# and the npm assets `sparsetron report` inlines (Chart.js, pinned in tools/report/package.json).
set -euo pipefail

# chromium: the report test renders the HTML report headless. nodejs/npm: Chart.js for the report.
# OpenMPI: the MPI-backed Comm and the data-parallel tests under mpirun (label mpi).
PACKAGES=(cmake ninja-build g++ clang-format
          libopenblas-pthread-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgtest-dev
          libpcre2-dev
          chromium libopenmpi-dev openmpi-bin)
command -v npm >/dev/null 2>&1 || PACKAGES+=(nodejs npm)

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all packages present"
fi

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ ! -f "$ROOT/tools/report/node_modules/chart.js/dist/chart.umd.js" ]; then
  echo "setup: installing Chart.js (npm ci in tools/report)"
  (cd "$ROOT/tools/report" && npm ci --no-audit --no-fund --loglevel=error)
fi
