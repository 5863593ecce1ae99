"""Prints what the engine must match in HF transformers' glm_moe_dsa (run on the GPU machine).

Writes the model's source files and a tiny model's state-dict names and shapes into $OUT.
"""
import inspect
import json
import os
import shutil

import torch
import transformers
from transformers.models.glm_moe_dsa import configuration_glm_moe_dsa, modeling_glm_moe_dsa

out = os.environ.get("OUT", ".")
print("transformers", transformers.__version__, "torch", torch.__version__)
for mod in (configuration_glm_moe_dsa, modeling_glm_moe_dsa):
    shutil.copy(inspect.getsourcefile(mod), os.path.join(out, os.path.basename(inspect.getsourcefile(mod))))
cfg = configuration_glm_moe_dsa.GlmMoeDsaConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=8, index_n_heads=2, index_head_dim=8, index_topk=4, first_k_dense_replace=1,
)
print(json.dumps(cfg.to_dict(), indent=1, default=str)[:6000])
model = modeling_glm_moe_dsa.GlmMoeDsaForCausalLM(cfg)
for k, v in model.state_dict().items():
    print(k, tuple(v.shape), v.dtype)
model.save_pretrained(os.path.join(out, "tiny_saved"), safe_serialization=True)
from safetensors import safe_open
with safe_open(os.path.join(out, "tiny_saved", "model.safetensors"), "pt") as f:
    print("SAVED KEYS:", sorted(f.keys()))
shutil.make_archive(os.path.join(out, "tiny_saved_cfg"), "zip", os.path.join(out, "tiny_saved"))
shutil.rmtree(os.path.join(out, "tiny_saved"))
