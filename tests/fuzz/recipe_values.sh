#!/usr/bin/env bash
# The recipe value fuzz (issue: every recipe value validated): each numeric recipe key (those
# `sparsetron keys` lists with a number) gets 0, -1, nan, inf, 2^31, 2^62 and a non-number, on
# `plan` and on a one-step `train`. Each case must either stop with a clear error (exit 1 or 2,
# the key named) or run correctly: exit 0 only for the settings accepted.txt lists (reviewed as
# meaningful: 0 for "none", large counts), with a finite loss and the value kept in the saved
# recipe. Never a signal, never a hang (each case has a deadline), never exit 0 on another value.
# Every case listed in accepted.txt must also run (so the list and the ranges stay in step).
# Usage: recipe_values.sh SPARSETRON_BINARY WORK_DIR
set -uo pipefail
bin=$1
work=$2
here=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work" && mkdir -p "$work"
start=$SECONDS
# One dataset for every train case (the bundled corpus, preprocessed once).
"$bin" preprocess -i "$here"/../../data/corpus/*.txt -o "$work/corpus" --workers 2 >/dev/null ||
  { echo "FAIL: preprocessing the corpus"; exit 1; }
"$bin" keys | grep -v '^#' | awk -F': ' '$2 ~ /^-?[0-9][0-9.e+-]*$/ {print $1}' >"$work/keys.txt"
values="0 -1 nan inf 2147483648 4611686018427387904 abc"
for key in $(cat "$work/keys.txt"); do
  for v in $values; do
    echo "plan $key $v"
    echo "train $key $v"
  done
done >"$work/cases.txt"

# One case: prints "<verdict> <mode> <key> <value> <detail>".
run_case() {
  mode=$1 key=$2 value=$3
  dir=$(mktemp -d "$work/case.XXXXXX")
  if [ "$mode" = plan ]; then
    timeout -s KILL 60 "$bin" plan --set "$key=$value" >"$dir/out" 2>&1
  else
    # One step: exit_interval stops it (train_iters when the key is exit_interval itself).
    stop="--set exit_interval=1"
    [ "$key" = exit_interval ] && stop="--set train_iters=1"
    timeout -s KILL 60 "$bin" train -q --set "data_path=$work/corpus" --set "$key=$value" $stop \
      --out "$dir/o" >"$dir/out" 2>&1
  fi
  rc=$?
  first=$(grep -m1 . "$dir/out" | cut -c1-200)
  accepted=no
  grep -qx "$key $value" "$here/accepted.txt" && accepted=yes
  if [ $rc -eq 137 ] || [ $rc -eq 124 ]; then
    echo "HANG $mode $key $value (no answer in 60 s)"
  elif [ $rc -ge 128 ]; then
    echo "SIGNAL $mode $key $value (exit $rc: signal $((rc - 128)))"
  elif [ $rc -eq 1 ] || [ $rc -eq 2 ]; then
    if [ $accepted = yes ]; then
      echo "REFUSED-ACCEPTED $mode $key $value: $first"
    elif grep -q -- "$key" "$dir/out"; then
      echo "ERROR $mode $key $value"
    else
      echo "UNNAMED $mode $key $value: $first"
    fi
  elif [ $rc -ne 0 ]; then
    echo "EXIT$rc $mode $key $value: $first"
  elif [ $accepted = no ]; then
    echo "WRONG-EXIT0 $mode $key $value"
  elif [ "$mode" = train ]; then
    # A correct run: a finite loss, and the saved recipe holds the value as given.
    loss=$(grep -m1 -o '"lm_loss":[^,}]*' "$dir/o/metrics.jsonl" 2>/dev/null | cut -d: -f2)
    saved=$(grep -m1 "^$key: " "$dir"/o/checkpoints/iter_*/recipe.yaml 2>/dev/null | cut -d' ' -f2)
    if ! awk -v l="$loss" 'BEGIN { exit !(l != "" && l == l + 0 && l + 0 < 1e30) }'; then
      echo "WRONG-EXIT0 $mode $key $value (lm_loss '$loss')"
    elif ! awk -v a="$saved" -v b="$value" 'BEGIN { exit !(a != "" && a + 0 == b + 0) }'; then
      echo "WRONG-EXIT0 $mode $key $value (the saved recipe holds '$saved')"
    else
      echo "RAN $mode $key $value"
    fi
  else
    echo "RAN $mode $key $value"
  fi
  rm -rf "$dir"
}
export -f run_case
export bin work here
xargs -P "$(nproc)" -L 1 bash -c 'run_case "$@"' _ <"$work/cases.txt" >"$work/results.txt"

count() { grep -c "^$1 " "$work/results.txt"; }
bad=$(grep -cv -e '^ERROR ' -e '^RAN ' "$work/results.txt")
grep -v -e '^ERROR ' -e '^RAN ' "$work/results.txt"
echo "recipe value fuzz: $(wc -l <"$work/results.txt") cases over $(wc -l <"$work/keys.txt") numeric" \
  "keys x 7 values x {plan, train} in $((SECONDS - start)) s: $(count ERROR) clear errors," \
  "$(count RAN) correct runs, $(count SIGNAL) signals, $(count HANG) hangs," \
  "$(count WRONG-EXIT0) exit 0 on a wrong setting, $(count UNNAMED) errors not naming the key," \
  "$(count REFUSED-ACCEPTED) accepted settings refused"
[ "$bad" -eq 0 ]
