#!/usr/bin/env bash
# On the GPU machine: this build (B) against another build of the engine (A) in one call, on the
# proxy (recipes/glm5.2-proxy-h200.yaml): the backbone's forward+backward (no MTP, no indexer
# loss) and the full training step, each timed as a replayed graph, runs in the order A B B A.
# A is a tarball of the other build's build/default/lib/libsparsetron.so and
# build/default/bin/sparsetron (made with `tar -cJf A.tar.xz build/default/lib/libsparsetron.so
# build/default/bin/sparsetron` in its checkout: ~4 MB, so both builds travel to the machine).
# JSON lines into OUT/backbone.jsonl and OUT/step.jsonl; the comparison on stdout
# (tools/bench/ab_compare.py: medians, means with standard errors, B against A).
# MEASURES (default "backbone step") picks the measures, e.g. one per call when both do not fit
# one call's time; ARMS (default "A B B A") the order of the runs of each measure; RECIPE the
# recipe and overlays (default the proxy; on an H100 the full step needs
# recipes/glm5.2-proxy-h200.yaml,recipes/overlays/h100.yaml).
# Usage: bench/scripts/compare-builds.sh A.tar.xz A_COMMIT B_COMMIT OUT [ITERS]
set -uo pipefail
tarball=${1:?usage: compare-builds.sh A.tar.xz A_COMMIT B_COMMIT OUT [ITERS]}
a_commit=${2:?} b_commit=${3:?} out=${4:?} iters=${5:-10}
mkdir -p "$out" "$out/a"
tar -xJf "$tarball" -C "$out/a"
declare -A bin=([A]="$out/a/build/default/bin/sparsetron" [B]=build/default/bin/sparsetron)
declare -A commit=([A]="$a_commit" [B]="$b_commit")
recipe="--recipe ${RECIPE:-recipes/glm5.2-proxy-h200.yaml}"
measure() {  # NAME ARM OPTIONS...
  local name=$1 arm=$2
  shift 2
  # shellcheck disable=SC2068,SC2086  # the options are words
  timeout 150 scripts/gpu-run.sh "${bin[$arm]}" bench $recipe --commit "${commit[$arm]}" $@ \
    --variants graph --warmup 3 --iters "$iters" --json "$out/$name.jsonl" \
    >>"$out/$name-$arm.log" 2>&1 || echo "$name $arm failed (see $out/$name-$arm.log)"
  grep -h "graph " "$out/$name-$arm.log" | tail -1 | sed "s/^/$name $arm /"
}
measures=${MEASURES:-backbone step}
for name in $measures; do
  for arm in ${ARMS:-A B B A}; do
    if [ "$name" = backbone ]; then
      measure backbone $arm --set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward
    else
      measure step $arm
    fi
  done
done
for name in $measures; do
  echo "== $name (B against A)"
  python3 tools/bench/ab_compare.py "$out/$name.jsonl" --labels A,B,B,A
done
rm -rf "$out/a"
