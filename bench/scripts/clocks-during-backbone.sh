#!/usr/bin/env bash
# On nvidia-h200: what the GPU's clocks and power do while the proxy backbone's forward+backward
# runs (graph, 3 warm-up + 20 timed), nvidia-smi sampled every 20 ms into OUT/smi.csv; the time of
# a memset of the step's gradient bytes (16.09 GiB, what every timed step zeroes) and of a device
# copy of the same size by PyTorch; then the perf harness's engine grouped GEMM lines twice.
# Usage: bench/scripts/clocks-during-backbone.sh OUT_DIR COMMIT
set -uo pipefail
out=${1:?usage: clocks-during-backbone.sh OUT_DIR COMMIT}
commit=${2:-unknown}
mkdir -p "$out"
bin=build/default/bin
q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
q=$q,clocks_event_reasons.active
nvidia-smi --query-gpu=$q --format=csv,noheader -lms 20 >"$out/smi.csv" 2>"$out/smi.err" &
smi=$!
sleep 1
scripts/gpu-run.sh $bin/sparsetron bench --recipe recipes/glm5.2-proxy-h200.yaml --commit "$commit" \
  --set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --forward-backward --variants graph \
  --warmup 3 --iters 20 --json "$out/backbone.jsonl" >"$out/backbone.log" 2>&1 ||
  echo "backbone bench failed"
sleep 1
kill $smi
grep -v "^\[graph\]" "$out/backbone.log" | tail -2
python3 - "$out/smi.csv" <<'PY'
import sys
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 6]
busy = [r for r in rows if r[5].strip().rstrip(" %").isdigit() and int(r[5].rstrip(" %")) >= 90]
print(f"smi samples {len(rows)}, at >= 90% utilization {len(busy)}")
def stats(col, unit):
    v = sorted(float(r[col].split()[0]) for r in busy if r[col].split()[0][0].isdigit())
    if v: print(f"  {unit}: min {v[0]:.0f} median {v[len(v)//2]:.0f} max {v[-1]:.0f}")
stats(1, "SM MHz"); stats(3, "power W"); stats(4, "temperature C")
from collections import Counter
print("  event reasons while busy:", dict(Counter(r[6].strip() for r in busy)))
PY
python3 - <<'PY'
import torch
n = int(16.09 * 2**30) // 4
x = torch.empty(n, dtype=torch.float32, device="cuda")
y = torch.empty(n, dtype=torch.float32, device="cuda")
for name, f in (("memset", lambda: x.zero_()), ("copy", lambda: y.copy_(x))):
    for _ in range(3): f()
    ts = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); f(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort()
    print(f"{name} of 16.09 GiB fp32: median {ts[5]:.2f} ms")
PY
for round in 1 2; do
  SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES=gemm timeout 60 scripts/gpu-run.sh \
    $bin/test_gpu --gtest_filter='CudaOpsPerf.GroupedExpertGemm' 2>&1 | grep "^\[perf\]" |
    sed "s/^/round $round /" | tee -a "$out/perf-grouped.txt"
done
# The routing the grouped GEMMs see: per-expert loads of the first steps of the proxy's backbone
# (metrics.jsonl's expert loads), to compare with the harness's uniform / skewed / ragged lines.
timeout 150 scripts/gpu-run.sh $bin/sparsetron train --recipe recipes/glm5.2-proxy-h200.yaml \
  --device cuda --set mtp_num_layers=0 --set dsa_indexer_loss_coeff=0 --set train_iters=2 \
  --no-save --quiet --out /tmp/loads >"$out/train.log" 2>&1 || echo "train failed"
cp /tmp/loads/metrics.jsonl "$out/metrics.jsonl" 2>/dev/null
