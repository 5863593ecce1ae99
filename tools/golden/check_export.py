"""Loads a Sparsetron checkpoint with HuggingFace transformers (run on the GPU machine) and prints
HF's mean next-token loss over a token file, to compare with `sparsetron eval --json` on the same
checkpoint: the engine's checkpoints are HF glm_moe_dsa directories.

Usage: python3 check_export.py CHECKPOINT_DIR TOKENS_FILE
"""
import json
import sys

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

ckpt, tokens = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
total, count = 0.0, 0
with torch.no_grad():
    for line in open(tokens):
        doc = [int(t) for t in line.split()]
        if len(doc) < 2:
            continue
        logits = model(torch.tensor([doc])).logits[0].float()
        total += F.cross_entropy(logits[:-1], torch.tensor(doc[1:]), reduction="sum").item()
        count += len(doc) - 1
print(json.dumps({"lm_loss": total / count, "targets": count}))
