#!/usr/bin/env bash
# Launch N processes of a command on this host, torchrun-style (RANK, WORLD_SIZE, LOCAL_RANK,
# MASTER_ADDR, MASTER_PORT), one GPU each, NVLink multicast off. Each rank's output goes to
# $LOG_DIR/rank<r>.log (default: the current folder); rank 0's is also printed at the end.
# Exits non-zero if any rank failed. Usage: scripts/launch-local.sh N COMMAND [ARGS...]
# Example: scripts/launch-local.sh 2 scripts/gpu-run.sh build/default/bin/sparsetron bench \
#            --recipe recipes/glm5.2-proxy-h200.yaml --set world_size=2 --set global_batch_size=2
set -uo pipefail
n=${1:?usage: launch-local.sh N COMMAND [ARGS...]}
shift
log_dir=${LOG_DIR:-.}
mkdir -p "$log_dir"
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500} WORLD_SIZE=$n
export NCCL_NVLS_ENABLE=0
pids=()
for ((r = 0; r < n; r++)); do
  RANK=$r LOCAL_RANK=$r "$@" >"$log_dir/rank$r.log" 2>&1 &
  pids+=($!)
done
fail=0
for ((r = 0; r < n; r++)); do
  if ! wait "${pids[$r]}"; then
    echo "launch-local: rank $r failed (log: $log_dir/rank$r.log)" >&2
    fail=1
  fi
done
cat "$log_dir/rank0.log"
exit $fail
