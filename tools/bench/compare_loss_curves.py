"""Compares two training runs' loss curves (metrics.jsonl of `sparsetron train`): a candidate
(e.g. fp8_recipe: blockwise) against a baseline (bf16) on the same data and seed.

Usage: python3 compare_loss_curves.py BASE CANDIDATE [--window 10] [--skip 20]
           [--tolerance 0.01] [--drift DRIFT] [--json OUT.json --note TEXT]
BASE, CANDIDATE and DRIFT are metrics.jsonl files, or RECORD.json:KEY for a curve stored in a
bench/results record (an lm_loss list for steps 1..N under KEY).
The first stated tolerance (fixed before the first 200-step run, 2026-11-30): after the first
`skip` steps, the candidate's `window`-step moving average of lm_loss stays within `tolerance`
(relative) of the baseline's at every step. Prints the summary and exits 1 when the bound fails.
With --drift (a second run of the base's precision, e.g. another bf16 build) the summary adds
the worst gap per window (--windows) of the candidate and of the drift run against the base, and
the bound proposed after the first runs (docs/perf/log/2026-11-30-fp8-training.md): after step
--late-from the moving average within --late-bound, the mean over --mean-window within
--mean-bound, and in --early-window at most --early-factor times the drift run's worst gap; the
exit status then follows that bound.
"""
import argparse
import json
import sys


def load(path):
    if ".json:" in path:  # a curve stored in a record: lm_loss for steps 1..N
        record, key = path.split(".json:", 1)
        curve = json.load(open(record + ".json"))[key]
        return {i + 1: {"lm_loss": v} for i, v in enumerate(curve)}
    rows = [json.loads(l) for l in open(path) if l.strip()]
    return {int(r["step"]): r for r in rows if "lm_loss" in r}


def window_range(text):
    lo, hi = text.split("-")
    return int(lo), int(hi)


def worst_in(steps, rel, lo, hi):
    inside = [(r, s) for s, r in zip(steps, rel) if lo <= s <= hi]
    if not inside:
        return None
    gap, step = max(inside)
    return {"gap": gap, "step": step}


def mean_over(steps, values, lo, hi):
    inside = [v for s, v in zip(steps, values) if lo <= s <= hi]
    return sum(inside) / len(inside) if inside else None


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
    ap.add_argument("--drift", help="a second run of the base's precision (drift reference)")
    ap.add_argument("--windows", default="21-50,51-100,101-200")
    ap.add_argument("--late-from", type=int, default=51)
    ap.add_argument("--late-bound", type=float, default=0.06)
    ap.add_argument("--mean-window", default="101-200")
    ap.add_argument("--mean-bound", type=float, default=0.01)
    ap.add_argument("--early-window", default="21-50")
    ap.add_argument("--early-factor", type=float, default=2.0)
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
    if a.drift:
        drift = load(a.drift)
        steps_d = [s for s in steps if s in drift]
        if steps_d != steps:
            sys.exit("the drift run lacks some of the compared steps")
        d = [drift[s]["lm_loss"] for s in steps]
        rel_d = [abs(x - y) / abs(y) for x, y in zip(moving(d, a.window), mb)]
        windows = [window_range(w) for w in a.windows.split(",")]
        summary["windows"] = {
            f"{lo}-{hi}": {"candidate": worst_in(steps, rel, lo, hi),
                           "drift": worst_in(steps, rel_d, lo, hi)} for lo, hi in windows}
        mlo, mhi = window_range(a.mean_window)
        elo, ehi = window_range(a.early_window)
        late = worst_in(steps, rel, a.late_from, steps[-1])
        mean_b, mean_c = mean_over(steps, b, mlo, mhi), mean_over(steps, c, mlo, mhi)
        early, early_d = worst_in(steps, rel, elo, ehi), worst_in(steps, rel_d, elo, ehi)
        checks = {
            "late": {"worst": late, "bound": a.late_bound,
                     "holds": late is not None and late["gap"] <= a.late_bound},
            "mean": {"base": mean_b, "candidate": mean_c, "bound": a.mean_bound,
                     "holds": mean_b is not None and
                     abs(mean_c - mean_b) <= a.mean_bound * abs(mean_b)},
            "early": {"worst": early, "drift_worst": early_d, "factor": a.early_factor,
                      "holds": early is not None and early_d is not None and
                      early["gap"] <= a.early_factor * early_d["gap"]},
        }
        summary["proposed_bound"] = checks
        ok = all(v["holds"] for v in checks.values())
        summary["within_proposed_bound"] = ok
    print(json.dumps(summary))
    if a.json:
        json.dump({"note": a.note, "summary": summary, "steps": steps, "base_lm_loss": b,
                   "candidate_lm_loss": c}, open(a.json, "w"), indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
