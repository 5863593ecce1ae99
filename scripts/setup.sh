#!/usr/bin/env bash
# Installs the Debian packages Sparsetron builds with (skips apt when all are present).
set -euo pipefail

PACKAGES=(cmake ninja-build g++ clang-format
          libopenblas-pthread-dev libyaml-cpp-dev nlohmann-json3-dev libcli11-dev libgtest-dev)

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
