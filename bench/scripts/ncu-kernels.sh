#!/usr/bin/env bash
# On the GPU machine: ncu (clocks left alone) of the first launch of each kernel matching REGEX in
# one ops_perf test (tests/ops/ops_perf.cpp), all sections, the report and its details and SASS-source pages under OUT.
# Usage: bench/scripts/ncu-kernels.sh OUT NAME REGEX GTEST_FILTER [COUNT]
set -uo pipefail
out=${1:?usage: ncu-kernels.sh OUT NAME REGEX GTEST_FILTER [COUNT]}
name=$2 regex=$3 filter=$4 count=${5:-1}
timeout 300 ncu --clock-control none --set full --import-source yes \
  --kernel-name "regex:$regex" --launch-count "$count" -f -o "$out/$name" \
  scripts/gpu-run.sh build/default/bin/ops_perf --gtest_filter="$filter" >"$out/$name-run.log" 2>&1
echo "ncu $name rc=$?"
ncu --import "$out/$name.ncu-rep" --page details >"$out/$name-details.txt" 2>&1
ncu --import "$out/$name.ncu-rep" --page source --csv --print-source sass >"$out/$name-sass.csv" 2>&1
grep -E "Duration|Compute \(SM\) Throughput|L2 Cache Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Issued Ipc|No Eligible" "$out/$name-details.txt"
