#!/usr/bin/env bash
# README command (2): set up, check formatting against .clang-format, build (CUDA code included
# when nvcc is present; the .cu host code with the C++ warnings), run the cpu tests, the recipe
# value fuzz and the MPI tests; build every target again with the `cpu` preset (no CUDA: what a
# machine without nvcc builds) and run its cpu tests; then build the CPU code (the MPI targets
# included) under AddressSanitizer + UndefinedBehaviorSanitizer and run the cpu and mpi tests there.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# Each stage's wall time, so a slow CI run shows where the time went.
stage_start=$SECONDS
stage() {
  echo "   (previous stage: $((SECONDS - stage_start)) s)"
  stage_start=$SECONDS
  echo "== $*"
}
scripts/setup.sh

stage "format check (.clang-format)"
scripts/format.sh --check

# Hopper code only: the engine's kernels are Hopper's, and Blackwell's pass doubles the CUDA
# compile (`cmake --preset default` builds both where nvcc supports sm_100a).
stage "build: default preset (release, CUDA when available, sm_90a)"
cmake --preset default -DSPARSETRON_CUDA_BLACKWELL=OFF
cmake --build --preset default
stage "tests: cpu (and gpu, which skip without a GPU)"
ctest --preset default -L 'cpu|gpu'
stage "tests: recipe value fuzz (every numeric key on plan and a one-step train)"
ctest --preset default -L fuzz --output-on-failure
stage "tests: mpi (data, expert and context parallelism over 2 and 4 MPI ranks on CPU)"
ctest --preset default -L mpi --output-on-failure

stage "build: cpu preset (no CUDA toolkit: every target, the gpu tests' skipping stubs included)"
cmake --preset cpu
cmake --build --preset cpu
stage "tests: cpu, built without CUDA"
ctest --preset cpu -L 'cpu|gpu'

stage "build: asan preset (ASan + UBSan, no CUDA, no gpu test targets; the MPI targets included)"
cmake --preset asan
cmake --build --preset asan
stage "tests: cpu under ASan + UBSan"
ctest --preset asan -L cpu
# Under ASan: the ranks on 2 MPI processes (every Mpi.* test), pipeline stages on 8, the
# collective watchdog and stopping by signal. The 4-, 8- and 16-rank runs stay in the release
# build (under ASan the 16-rank ones take six minutes, with tolerances set for the release
# build's arithmetic).
stage "tests: mpi under ASan + UBSan (the ranks, the collective watchdog, stopping by signal)"
ctest --preset asan-mpi -L mpi -E 'mpi_seed_|_np4|_np16|dynamic_cp_ep_np8' --output-on-failure
stage "done in $SECONDS s"
