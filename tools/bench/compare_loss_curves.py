"""Compares two training runs' loss curves (metrics.jsonl of `sparsetron train`): a candidate
(e.g. fp8_recipe: blockwise) against a baseline (bf16) on the same data and seed.

Usage: python3 compare_loss_curves.py BASE.jsonl CANDIDATE.jsonl [--window 10] [--skip 20]
           [--tolerance 0.01] [--json OUT.json --note TEXT]
The stated tolerance (fixed before the first 200-step run, 2026-11-30): after the first `skip` steps, the candidate's `window`-step moving average of
lm_loss stays within `tolerance` (relative) of the baseline's at every step. Prints the per-step
table's summary and exits 1 when the bound fails.
"""
import argparse
import json
import sys


def load(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    return {int(r["step"]): r for r in rows if "lm_loss" in r}


def median_ms(run, steps, skip):
    ms = sorted(run[s]["step_ms"] for s in steps if s > skip and "step_ms" in run[s])
    return ms[len(ms) // 2] if ms else None


def moving(values, window):
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("candidate")
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--tolerance", type=float, default=0.01)
    ap.add_argument("--tail", type=int, default=20, help="also report the mean over the last N")
    ap.add_argument("--json")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    base, cand = load(a.base), load(a.candidate)
    steps = sorted(set(base) & set(cand))
    if not steps:
        sys.exit("no common steps with lm_loss")
    b = [base[s]["lm_loss"] for s in steps]
    c = [cand[s]["lm_loss"] for s in steps]
    mb, mc = moving(b, a.window), moving(c, a.window)
    rel = [abs(x - y) / abs(y) for x, y in zip(mc, mb)]
    checked = [(s, r) for s, r in zip(steps, rel) if s > a.skip]
    worst = max(checked, key=lambda x: x[1]) if checked else (None, 0.0)
    ok = worst[1] <= a.tolerance
    summary = {
        "steps": len(steps),
        "first": {"step": steps[0], "base": b[0], "candidate": c[0]},
        "last": {"step": steps[-1], "base": b[-1], "candidate": c[-1]},
        "window": a.window,
        "skip": a.skip,
        "tolerance": a.tolerance,
        "worst_relative_gap": worst[1],
        "worst_step": worst[0],
        "within_tolerance": ok,
        # Descriptive, not part of the bound: the last `tail` steps' mean loss of each run and
        # the candidate's step time relative to the base's (medians after the skip).
        "tail_mean": {"steps": a.tail, "base": sum(b[-a.tail:]) / len(b[-a.tail:]),
                      "candidate": sum(c[-a.tail:]) / len(c[-a.tail:])},
        "median_step_ms": {"base": median_ms(base, steps, a.skip),
                           "candidate": median_ms(cand, steps, a.skip)},
    }
    print(json.dumps(summary))
    if a.json:
        json.dump({"note": a.note, "summary": summary, "steps": steps, "base_lm_loss": b,
                   "candidate_lm_loss": c}, open(a.json, "w"), indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
