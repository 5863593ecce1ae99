#!/usr/bin/env bash
# On nvidia-h200: the perf harness's engine grouped GEMM lines (uniform, skewed, ragged and
# training routing, with the dense comparators), then HuggingFace glm_moe_dsa's backbone
# forward+backward with nvidia-smi sampled every 20 ms (OUT/smi-hf.csv): whether the PyTorch
# stack also runs at the GPU's power cap (bench/scripts/clocks-during-backbone.sh did it for ours).
# Usage: bench/scripts/routing-lines-and-hf-power.sh OUT_DIR
set -uo pipefail
out=${1:?usage: routing-lines-and-hf-power.sh OUT_DIR}
mkdir -p "$out"
SPARSETRON_OPS_PERF=1 SPARSETRON_OPS_PERF_LINES=gemm timeout 90 scripts/gpu-run.sh \
  build/default/bin/test_gpu --gtest_filter='CudaOpsPerf.GroupedExpertGemm' 2>&1 |
  grep "^\[perf\]" | tee "$out/perf-grouped.txt"
q=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
q=$q,clocks_event_reasons.active
nvidia-smi --query-gpu=$q --format=csv,noheader -lms 20 >"$out/smi-hf.csv" 2>/dev/null &
smi=$!
timeout 150 python3 tools/bench/hf_glm_moe_dsa.py --warmup 3 --iters 10 >"$out/hf.jsonl" \
  2>"$out/hf.err" || echo "HF baseline failed"
kill $smi
tail -1 "$out/hf.jsonl"
python3 - "$out/smi-hf.csv" <<'PY'
import sys
from collections import Counter
rows = [l.split(", ") for l in open(sys.argv[1]) if l.count(",") >= 6]
busy = [r for r in rows if r[5].rstrip(" %").isdigit() and int(r[5].rstrip(" %")) >= 90]
print(f"smi samples {len(rows)}, at >= 90% utilization {len(busy)}")
for col, unit in ((1, "SM MHz"), (3, "power W")):
    v = sorted(float(r[col].split()[0]) for r in busy)
    if v: print(f"  {unit}: min {v[0]:.0f} median {v[len(v)//2]:.0f} max {v[-1]:.0f}")
print("  event reasons while busy:", dict(Counter(r[6].strip() for r in busy)))
PY
