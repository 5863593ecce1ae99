#!/usr/bin/env bash
# README command (2): set up, build (CUDA code included when nvcc is present), run the cpu tests
# and the MPI data-parallel tests (mpirun -np 2 and -np 4), then build the CPU code again under AddressSanitizer + UndefinedBehaviorSanitizer and run the
# cpu tests there, and check formatting against .clang-format.
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

stage "build: default preset (release, CUDA when available)"
cmake --preset default
cmake --build --preset default
stage "tests: cpu (and gpu, which skip without a GPU)"
ctest --preset default -L 'cpu|gpu'
stage "tests: mpi (data, expert and context parallelism over 2 and 4 MPI ranks on CPU)"
ctest --preset default -L mpi --output-on-failure

stage "build: asan preset (ASan + UBSan, no CUDA, no MPI or gpu test targets)"
cmake --preset asan
cmake --build --preset asan
stage "tests: cpu under ASan + UBSan"
ctest --preset asan -L cpu
stage "done in $SECONDS s"
