# Sourced (not run) by the long-context one-call scripts (long-context-{streamed-loss,moe-rows,
# step32k,64k}.sh), which set `out` (the call's $OUT) and `c` (the commit recorded) first.
R=recipes/glm5.2-proxy-h200.yaml
# The backbone setting of issue 36: no MTP, no indexer loss, forward + backward only.
BACKBONE="--set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward"
# bench_run NAME ITERS [bench options...]: graph replays, 2 warm-up + ITERS timed, the log into
# $out/NAME.log and the JSON line into $out/bench.jsonl; prints the result rows (or the failure).
bench_run() {
  local name=$1 iters=$2
  shift 2
  timeout "${BENCH_TIMEOUT:-200}" scripts/gpu-run.sh build/default/bin/sparsetron bench \
    --recipe $R --commit "$c" --variants graph --warmup 2 --iters "$iters" \
    --json "$out/bench.jsonl" "$@" >"$out/$name.log" 2>&1 ||
    { echo "$name failed"; tail -3 "$out/$name.log"; }
  grep -A3 "^variant" "$out/$name.log" | grep -v "^variant"
}
# The GPU and test_gpu (log in $out/test_gpu.log), its summary printed.
run_test_gpu() {
  nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv
  timeout "${TEST_GPU_TIMEOUT:-240}" scripts/gpu-run.sh build/default/bin/test_gpu >"$out/test_gpu.log" 2>&1
  echo "test_gpu rc=$?"
  grep -E "^\[  (PASSED|FAILED) |FAILED  \]" "$out/test_gpu.log" | head -20
}
