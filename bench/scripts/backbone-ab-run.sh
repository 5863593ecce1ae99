#!/usr/bin/env bash
# Sourced by the A/B scripts of the masked attention's fused kernels: runs the GPU suite into
# $out and stops the script when a sparse MHA test failed (the kernels under test are wrong: no
# benches), then defines `backbone NAME`, which times the proxy backbone's forward+backward as a
# graph (3 warm-up + BB_ITERS timed, default 10), appends its JSON line to $out/backbone.jsonl,
# its output to $out/NAME.log, and prints the graph row prefixed by NAME; and
# `ncu_times NAME REGEX`: ncu's times of the kernels matching REGEX over one eager backbone
# forward+backward (into $out/ncu-NAME.csv), the summary's first lines prefixed by "ncu NAME".
# An env assignment before either applies to its run. Needs $out and $commit; sets $bin, $r and $bb.
# STOP_ON (default SparseMha): the test names whose failure stops the script.
bench/scripts/gpu-suite.sh "$out"
grep -h "FAILED" "$out/gpu.log" | head -20
if grep -q "FAILED.*${STOP_ON:-SparseMha}" "$out/gpu.log"; then
  echo "${STOP_ON:-SparseMha} tests failed: no benches"
  exit 1
fi
bin=build/default/bin
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0"
backbone() {  # NAME: the backbone's forward+backward as a graph
  # shellcheck disable=SC2086  # the options are words
  timeout $((90 + ${BB_ITERS:-10})) scripts/gpu-run.sh $bin/sparsetron bench $r $bb \
    --forward-backward --variants graph --warmup 3 --iters "${BB_ITERS:-10}" \
    --json "$out/backbone.jsonl" >"$out/$1.log" 2>&1 || echo "$1 failed"
  grep -h "graph " "$out/$1.log" | tail -1 | sed "s/^/$1 /"
}
ncu_times() {  # NAME REGEX
  # shellcheck disable=SC2086  # the options are words
  timeout 120 scripts/gpu-run.sh ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --kernel-name "regex:$2" $bin/sparsetron bench $r $bb --forward-backward --warmup 0 \
    --iters 1 >"$out/ncu-$1.csv" 2>/dev/null || echo "ncu $1 failed"
  python3 tools/bench/ncu_summary.py "$out/ncu-$1.csv" 2>&1 | head -4 | sed "s/^/ncu $1 /"
}
