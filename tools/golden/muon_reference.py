"""One Muon step in PyTorch (fp32), written from SPEC §7, for the engine's golden test.

Per-head split of q_b_proj and kv_b_proj, an unsplit o_proj, Nesterov momentum, decoupled weight
decay, the spectral scale and the quintic Newton-Schulz schedule. Writes
tests/fixtures/muon/step.json with the inputs (weights, gradients, momentum) and the outputs.
Usage: python3 muon_reference.py OUTPUT_JSON
"""
import json
import sys

import torch

torch.manual_seed(7)
QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
H, NOPE, ROPE, V, QR, KR, HID = 2, 4, 2, 3, 6, 5, 7
LR, WD, BETA, EXTRA = 0.02, 0.1, 0.95, 1.3


def newton_schulz(u):
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / (x.norm() + 1e-7)
    for a, b, c in QUINTIC:
        A = x @ x.T
        B = b * A + c * (A @ A)
        x = a * x + B @ x
    return x.T if u.shape[0] > u.shape[1] else x


def slices(name, rows):
    if name == "q_b_proj":
        per, first = NOPE + ROPE, NOPE
    elif name == "kv_b_proj":
        per, first = NOPE + V, NOPE
    else:
        return [list(range(rows))]
    out = []
    for h in range(H):
        out.append(list(range(h * per, h * per + first)))
        out.append(list(range(h * per + first, (h + 1) * per)))
    return out


def muon_step(name, w, g, m):
    w = w * (1 - LR * WD)
    m = BETA * m + (1 - BETA) * g
    u = (1 - BETA) * g + BETA * m  # Nesterov
    for rows in slices(name, w.shape[0]):
        o = newton_schulz(u[rows])
        scale = max(len(rows), w.shape[1]) ** 0.5 * EXTRA  # spectral
        w[rows] = w[rows] - LR * scale * o
    return w, m


shapes = {"q_b_proj": (H * (NOPE + ROPE), QR), "kv_b_proj": (H * (NOPE + V), KR), "o_proj": (HID, H * V)}
out = {"hyper": {"lr": LR, "weight_decay": WD, "momentum": BETA, "extra": EXTRA, "heads": H,
                 "nope": NOPE, "rope": ROPE, "v": V, "q_lora": QR, "kv_lora": KR, "hidden": HID},
       "params": {}}
for name, shape in shapes.items():
    w, g, m = (torch.randn(shape, dtype=torch.float32) for _ in range(3))
    w1, m1 = muon_step(name, w.clone(), g, m.clone())
    out["params"][name] = {k: t.flatten().tolist() for k, t in
                           {"w": w, "g": g, "m": m, "w1": w1, "m1": m1}.items()}
    out["params"][name]["shape"] = list(shape)
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
print("torch", torch.__version__, "wrote", sys.argv[1])
