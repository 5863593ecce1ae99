#!/usr/bin/env bash
# On the GPU machine: run a command with the runtime libraries matching the build (the Python
# venv's cuDNN 9.19 / NCCL 2.28.9 / CUDA 13 libraries first on LD_LIBRARY_PATH, DESIGN §5) and
# NVLink multicast off. Usage: scripts/gpu-run.sh COMMAND [ARGS...]
set -euo pipefail
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null || true)
for lib in cudnn nccl cu13 cublas; do
  d="$site/nvidia/$lib/lib"
  [ -d "$d" ] && LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done
export LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
exec "$@"
