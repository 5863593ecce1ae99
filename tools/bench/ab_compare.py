"""A/B comparison of `sparsetron bench --json` lines: per arm, the runs' medians, and the mean of
all its replays with the standard error of that mean; each arm against the first: the difference
of the means, its standard error (the two errors in quadrature) and the ratio of the medians'
means. Replays drift with power and clocks, so these errors are lower bounds: read a difference
under ~2 standard errors as no difference.

Usage: python3 ab_compare.py FILE.jsonl [--labels A,B,A,B] [--variant forward_backward.graph]
Arms: --labels names the file's lines in order (the scripts append A and B to one file); without
it, a line's `env` object (history.jsonl's A/B runs) and commit name its arm.
"""
import argparse
import json
import math


def arm_of(rec):
    env = rec.get("env")
    tag = ",".join(f"{k}={v}" for k, v in sorted(env.items())) if env else "engine"
    return f"{rec.get('commit', '?')} {tag}"


def stats(xs):
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    return mean, sd / math.sqrt(n)


def compare(records, labels=None, variant=None):
    """Returns [(arm, medians, mean, se)] in first-seen order."""
    if variant:
        records = [r for r in records if r.get("variant") == variant]
    if labels is not None and len(labels) != len(records):
        raise SystemExit(f"{len(labels)} labels for {len(records)} lines")
    arms = {}
    for i, r in enumerate(records):
        arm = labels[i] if labels is not None else arm_of(r)
        a = arms.setdefault(arm, {"medians": [], "samples": []})
        a["medians"].append(r["median_ms"])
        a["samples"].extend(r["step_ms"])
    out = []
    for arm, a in arms.items():
        mean, se = stats(a["samples"])
        out.append((arm, a["medians"], mean, se))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--labels", default=None)
    ap.add_argument("--variant", default=None)
    a = ap.parse_args()
    records = [json.loads(l) for l in open(a.file) if l.strip()]
    labels = a.labels.split(",") if a.labels else None
    rows = compare(records, labels, a.variant)
    base = rows[0]
    for arm, medians, mean, se in rows:
        line = f"{arm:40s} medians {' '.join(f'{m:.1f}' for m in medians)}  mean {mean:.2f} +- {se:.2f} ms"
        if arm != base[0]:
            d, e = mean - base[2], math.hypot(se, base[3])
            ratio = (sum(medians) / len(medians)) / (sum(base[1]) / len(base[1]))
            line += f"  vs {base[0]}: {d:+.2f} +- {e:.2f} ms ({d / e if e else 0:+.1f} s.e.), medians {ratio:.4f}x"
        print(line)


if __name__ == "__main__":
    main()
