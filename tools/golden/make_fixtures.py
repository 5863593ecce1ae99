"""Golden fixtures from HuggingFace transformers' glm_moe_dsa (run on the GPU machine).

For each configuration: builds a tiny random GlmMoeDsaForCausalLM in fp32 with eager attention,
with weights large enough that logits are far from uniform, a non-zero expert bias, a DSA top-k
smaller than the documents and IndexShare patterns with shared layers; checks that no row has a tie
between its k-th and (k+1)-th valid indexer scores (SPEC §3: torch.topk leaves ties unordered) and
redraws the weights if one does; then runs each document on its own and writes

  tests/fixtures/golden/<name>/config.json, model.safetensors   (save_pretrained: HF names)
  tests/fixtures/golden/<name>/documents.txt                    (one document of token ids a line)
  tests/fixtures/golden/<name>/expected.json                    (per-document CE sums and counts,
                                                                 mean loss, a slice of logits)

Usage: python3 make_fixtures.py OUTPUT_DIR
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from transformers.models.glm_moe_dsa import configuration_glm_moe_dsa as cfgmod
from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

CONFIGS = {
    # 3 layers (1 dense + 2 MoE), IndexShare full/shared/full, top-k 4 of documents up to 19 tokens.
    "moe_dsa_share": dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, index_n_heads=8, index_head_dim=8,
        index_topk=4, first_k_dense_replace=1, indexer_types=["full", "shared", "full"],
        routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # 4 layers from the freq/offset rule (freq 2, offset 2: full, shared, full, shared), 4 heads,
    # top-k 6, 8 experts top-3, all MoE after the first layer.
    "freq_offset": dict(
        vocab_size=80, hidden_size=48, intermediate_size=64, moe_intermediate_size=12,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=3, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=6, index_n_heads=8, index_head_dim=12,
        index_topk=6, first_k_dense_replace=1, index_topk_freq=2, index_skip_topk_offset=2,
        routed_scaling_factor=1.5, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # Dense layers only, top-k larger than every document: sparse attention = dense causal.
    "dense_topk_covers": dict(
        vocab_size=64, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, q_lora_rank=16, kv_lora_rank=12,
        qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=6, index_n_heads=2, index_head_dim=8,
        index_topk=64, first_k_dense_replace=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
DOC_LENGTHS = [13, 19, 9, 16]


def draw_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights around 1, LayerNorm bias around 0
                base = 0.0 if name.endswith("bias") else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in ** 0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))


def index_scores(ix, hidden_states, q_resid, cos, sin):
    # The indexer's forward up to top-k (same operations as GlmMoeDsaIndexer.forward).
    b, s, _ = hidden_states.shape
    q = ix.wq_b(q_resid).view(b, s, ix.n_heads, ix.head_dim)
    q_rot, q_pass = torch.split(q, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    k = ix.k_norm(ix.wk(hidden_states)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [ix.qk_rope_head_dim, ix.head_dim - ix.qk_rope_head_dim], dim=-1)
    q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * ix.softmax_scale)
    w = ix.weights_proj(hidden_states).float() * (ix.n_heads ** -0.5)
    return torch.matmul(w.unsqueeze(-2), scores).squeeze(-2)[0]  # [S, S]


def min_boundary_gap(model, docs):
    """Smallest gap between the k-th and (k+1)-th valid indexer score over all rows and layers."""
    gaps = []
    hooks = []
    def hook(module, args, kwargs, output):
        hs, q_resid, (cos, sin) = args[0], args[1], args[2]
        sc = index_scores(module, hs, q_resid, cos, sin)
        k = module.index_topk
        for t in range(sc.shape[0]):
            if t + 1 > k:
                row = torch.sort(sc[t, : t + 1], descending=True).values
                gaps.append(float((row[k - 1] - row[k]) / max(1.0, float(row[0].abs()))))
    for layer in model.model.layers:
        if layer.self_attn.indexer is not None:
            hooks.append(layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        for d in docs:
            model(torch.tensor([d]))
    for h in hooks:
        h.remove()
    return min(gaps) if gaps else float("inf")


def main(out_root):
    for name, kw in CONFIGS.items():
        cfg = cfgmod.GlmMoeDsaConfig(**kw)
        cfg._attn_implementation = "eager"
        g = torch.Generator().manual_seed(1000 + len(name))
        docs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in DOC_LENGTHS]
        model = hf.GlmMoeDsaForCausalLM(cfg).eval()
        for seed in range(300):
            draw_weights(model, seed)
            gap = min_boundary_gap(model, docs)
            if gap > 1e-5:
                break
        else:
            raise SystemExit(f"{name}: no seed without top-k boundary ties")
        out = os.path.join(out_root, name)
        os.makedirs(out, exist_ok=True)
        model.save_pretrained(out, safe_serialization=True)
        result = {"documents": [], "seed": seed,
                  "min_topk_boundary_gap": gap if gap != float("inf") else None}
        total, count = 0.0, 0
        with torch.no_grad():
            for d in docs:
                logits = model(torch.tensor([d])).logits[0].float()
                ce = F.cross_entropy(logits[:-1], torch.tensor(d[1:]), reduction="sum").item()
                result["documents"].append({
                    "ce_sum": ce, "targets": len(d) - 1,
                    "logits_rows": [0, len(d) // 2, len(d) - 1],
                    "logits": [logits[r, :16].tolist() for r in (0, len(d) // 2, len(d) - 1)],
                    "logit_std": float(logits.std()),
                })
                total += ce
                count += len(d) - 1
        result["mean_loss"] = total / count
        with open(os.path.join(out, "documents.txt"), "w") as f:
            for d in docs:
                f.write(" ".join(map(str, d)) + "\n")
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump(result, f, indent=1)
        for extra in ("generation_config.json",):
            if os.path.exists(os.path.join(out, extra)):
                os.remove(os.path.join(out, extra))
        print(name, "seed", seed, "gap", gap, "mean loss", result["mean_loss"],
              "logit std", [d["logit_std"] for d in result["documents"]])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/golden")
