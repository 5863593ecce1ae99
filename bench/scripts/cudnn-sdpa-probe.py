"""Sizes the cuDNN route for the expanded masked attention (issue 7, target 1): PyTorch's cuDNN
SDPA at the proxy's attention shape (64 heads, qk 256, v 256, one 4096-token document), dense
causal and with an additive bias carrying a DSA-like top-k mask (causal; rows past the top-k keep
k of their keys), forward and forward+backward, against PyTorch's other backends. The output of
each masked variant is checked against the math backend in fp32 on the same inputs.

Usage: python3 bench/scripts/cudnn-sdpa-probe.py [--tokens 4096] [--topk 2048] [--json OUT]
"""
import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def dsa_mask(t, k, seed=0):
    """bool [t, t]: row i keeps every key <= i when i < k, else k random keys among 0..i
    (always the diagonal)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.rand(t, t, device="cuda", generator=g)
    causal = torch.ones(t, t, device="cuda", dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, -1.0)
    scores.diagonal().fill_(2.0)
    top = scores.topk(min(k, t), dim=1).indices
    keep = torch.zeros(t, t, device="cuda", dtype=torch.bool)
    keep.scatter_(1, top, True)
    return keep & causal


def time_ms(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--dqk", type=int, default=256)
    ap.add_argument("--dv", type=int, default=256)
    ap.add_argument("--json")
    a = ap.parse_args()
    t, h = a.tokens, a.heads
    torch.manual_seed(0)
    q = torch.randn(1, h, t, a.dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, h, t, a.dqk, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, h, t, a.dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(1, h, t, a.dv, device="cuda", dtype=torch.bfloat16)
    keep = dsa_mask(t, a.topk)
    bias = torch.zeros(t, t, device="cuda", dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    bias4 = bias.view(1, 1, t, t)
    pairs_causal = t * (t + 1) / 2
    pairs_dsa = float(keep.sum())
    # FLOPs: S and P V over the pairs (2 d each per head); backward 2.5x the forward (S recomputed).
    def flops(pairs, bwd):
        f = 2.0 * h * pairs * (a.dqk + a.dv)
        return f * (3.5 if bwd else 1.0)

    variants = {
        "cudnn causal": (SDPBackend.CUDNN_ATTENTION, dict(is_causal=True)),
        "cudnn bias": (SDPBackend.CUDNN_ATTENTION, dict(attn_mask=bias4)),
        "cudnn bool mask": (SDPBackend.CUDNN_ATTENTION, dict(attn_mask=keep.view(1, 1, t, t))),
        "flash causal": (SDPBackend.FLASH_ATTENTION, dict(is_causal=True)),
        "efficient bias": (SDPBackend.EFFICIENT_ATTENTION, dict(attn_mask=bias4)),
    }
    # Reference output for the masked variants on 8 heads in fp32 (math backend).
    hs = 8
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q[:, :hs].float(), k[:, :hs].float(),
                                             v[:, :hs].float(), attn_mask=bias4.float())
    results = []
    for name, (backend, kw) in variants.items():
        row = {"variant": name}
        try:
            with sdpa_kernel(backend):
                def fwd():
                    with torch.no_grad():
                        return F.scaled_dot_product_attention(q, k, v, **kw)

                def fwd_bwd():
                    o = F.scaled_dot_product_attention(q, k, v, **kw)
                    o.backward(do)

                out = fwd()
                if "is_causal" not in kw:
                    err = (out[:, :hs].float() - ref).abs().max().item()
                    row["max_abs_err_vs_math_fp32"] = err
                row["fwd_ms"] = time_ms(fwd)
                q.grad = k.grad = v.grad = None
                row["fwd_bwd_ms"] = time_ms(fwd_bwd)
                pairs = pairs_causal if "is_causal" in kw else pairs_dsa
                row["fwd_tflops_executed_pairs"] = flops(pairs, False) / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops_executed_pairs"] = flops(pairs, True) / row["fwd_bwd_ms"] / 1e9
                row["fwd_tflops_causal_count"] = flops(pairs_causal, False) / row["fwd_ms"] / 1e9
                row["fwd_bwd_tflops_causal_count"] = (flops(pairs_causal, True) /
                                                      row["fwd_bwd_ms"] / 1e9)
        except Exception as e:  # report what the backend refused
            row["error"] = str(e).splitlines()[0][:300]
        print(json.dumps(row), flush=True)
        results.append(row)
    summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "tokens": t, "topk": a.topk,
               "heads": h, "dqk": a.dqk, "dv": a.dv, "pairs_causal": pairs_causal,
               "pairs_dsa": pairs_dsa, "results": results}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
