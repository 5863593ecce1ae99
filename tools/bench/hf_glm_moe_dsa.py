"""Baseline: HuggingFace transformers' glm_moe_dsa at the proxy's shape, backbone forward+backward.

The proxy of recipes/glm5.2-proxy-h200.yaml (4 layers: 2 dense with FFN 12288 + 2 MoE of 16
experts top-8, hidden 6144, 64 heads, MLA 2048/512, qk 192+64, v 256, DSA 32 x 128 top-2048,
IndexShare freq 4 / offset 2, vocab 154880) in bf16 with sdpa attention and grouped_mm experts,
one 4096-token document, no MTP (HF has none), loss = LM cross-entropy; the indexer takes no
gradient (HF trains no indexer loss). Times forward + loss + backward with CUDA events after
warm-up and prints one JSON line (median/p95 ms, tokens/s, peak memory). PyTorch's allocator
runs with expandable segments (its advice when reserved memory fragments: at 16K tokens the
indexer's 32 GiB score tensor otherwise fails with half the reserved memory unused), and a step's
outputs are freed before the next step starts.

Usage (GPU machine): python3 hf_glm_moe_dsa.py [--warmup 3] [--iters 10] [--tokens 4096]
"""
import argparse
import json
import os
import statistics

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch
from transformers.models.glm_moe_dsa import configuration_glm_moe_dsa as cfgmod
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4096)
    a = ap.parse_args()
    cfg = cfgmod.GlmMoeDsaConfig(
        vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
        num_hidden_layers=4, first_k_dense_replace=2, num_attention_heads=64,
        num_key_value_heads=64, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=8,
        q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
        index_topk_freq=4, index_skip_topk_offset=2, routed_scaling_factor=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 8.0e6},
        max_position_embeddings=a.tokens)
    cfg._attn_implementation = "sdpa"
    used = {"attn": cfg._attn_implementation}
    if hasattr(cfg, "_experts_implementation"):
        cfg._experts_implementation = "grouped_mm"
        used["experts"] = cfg._experts_implementation
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = hf.GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16)
    model.train()
    used["params_M"] = sum(p.numel() for p in model.parameters()) / 1e6
    ids = torch.randint(0, cfg.vocab_size, (1, a.tokens), device="cuda")
    times = []
    torch.cuda.reset_peak_memory_stats()
    for it in range(a.warmup + a.iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        end.record()
        torch.cuda.synchronize()
        loss = float(out.loss)
        del out
        model.zero_grad(set_to_none=True)
        if it >= a.warmup:
            times.append(start.elapsed_time(end))
    times.sort()
    med = statistics.median(times)
    p95 = times[min(len(times) - 1, int(round(0.95 * (len(times) - 1))))]
    print(json.dumps({
        "variant": "hf_glm_moe_dsa_forward_backward", "median_ms": med, "p95_ms": p95,
        "step_ms": times, "tokens_per_s_per_gpu": a.tokens / (med * 1e-3),
        "peak_mem_mib": torch.cuda.max_memory_allocated() / 2**20, "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "implementation": used,
        "alloc_conf": os.environ["PYTORCH_CUDA_ALLOC_CONF"], "loss": loss}))


if __name__ == "__main__":
    main()
