#!/usr/bin/env bash
# On nvidia-h200: the GPU suite, then the engine's gradients (no whole-arena memset per step)
# against SPARSETRON_GRADIENTS=zeroed (every gradient zeroed at the step's start, every writer
# adding), interleaved, one process each: the proxy backbone's forward+backward (graph, 3 warm-up
# + 20 timed, two rounds) and the full proxy step (graph, 2 warm-up + 4 timed, one round). The
# JSON lines of each bench go to OUT/backbone.jsonl or OUT/step.jsonl in the order of the log lines.
# Usage: bench/scripts/gradients-ab.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: gradients-ab.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bench/scripts/gpu-suite.sh "$out"
bin=build/default/bin
r="--recipe recipes/glm5.2-proxy-h200.yaml --commit $commit"
bb="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward --warmup 3 --iters 20"
run() {  # name, SPARSETRON_GRADIENTS value, bench options
  local name=$1 value=$2
  shift 2
  # shellcheck disable=SC2068  # the options are words
  SPARSETRON_GRADIENTS=$value timeout 120 scripts/gpu-run.sh $bin/sparsetron bench $r $@ \
    --variants graph --json "$out/${name%%-*}.jsonl" >>"$out/$name.log" 2>&1 || echo "$name failed"
  grep -h "graph " "$out/$name.log" | tail -1 | sed "s/^/$name /"
}
for round in 1 2; do
  run backbone-engine "" $bb
  run backbone-zeroed zeroed $bb
done
run step-engine "" --warmup 2 --iters 4
run step-zeroed zeroed --warmup 2 --iters 4
