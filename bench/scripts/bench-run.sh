#!/usr/bin/env bash
# Sourced by the bench scripts: run NAME BENCH_OPTIONS... times the proxy step as a replayed
# graph (`sparsetron bench $r ... --variants graph`), appends its JSON line to $out/runs.jsonl and
# its output to $out/NAME.log, and prints the graph row prefixed by NAME. Needs $bin, $r and $out;
# RUN_TIMEOUT (default 110 s) bounds each run (setup alone takes ~40 s on the proxy).
run() {
  local name=$1
  shift
  # shellcheck disable=SC2068,SC2086  # the options are words
  timeout "${RUN_TIMEOUT:-110}" scripts/gpu-run.sh $bin/sparsetron bench $r $@ --variants graph \
    --json "$out/runs.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph " "$out/$name.log" | tail -1 | sed "s/^/$name /"
}
