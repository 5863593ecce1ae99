#!/usr/bin/env bash
# README command (2): set up, build (CUDA code included when nvcc is present), run the cpu tests
# and the MPI data-parallel tests (mpirun -np 2 and -np 4), then build the CPU code again under AddressSanitizer + UndefinedBehaviorSanitizer and run the
# cpu tests there, and check formatting against .clang-format.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
scripts/setup.sh

echo "== format check (.clang-format)"
scripts/format.sh --check

echo "== build: default preset (release, CUDA when available)"
cmake --preset default
cmake --build --preset default
echo "== tests: cpu (and gpu, which skip without a GPU)"
ctest --preset default -L 'cpu|gpu'
echo "== tests: mpi (data parallelism over 2 and 4 MPI ranks on CPU)"
ctest --preset default -L mpi --output-on-failure

echo "== build: asan preset (ASan + UBSan, no CUDA)"
cmake --preset asan
cmake --build --preset asan
echo "== tests: cpu under ASan + UBSan"
ctest --preset asan -L cpu
