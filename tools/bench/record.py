"""Merges one run's JSON lines into a bench/results record with the baseline comparison.

Usage: python3 record.py OUT.json --recipe R --commit C --baseline hf.jsonl RESULTS.jsonl...
Each line of RESULTS is a `sparsetron bench --json` record; the baseline file holds the HF line.
The record keeps every result, plus `baseline` and `speedup_vs_baseline` (baseline median /
result median) on the results whose variant is comparable (forward_backward).
"""
import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--baseline", required=True)
    ap.add_argument("--note", default="")
    ap.add_argument("results", nargs="+")
    a = ap.parse_args()
    base = [json.loads(l) for l in open(a.baseline) if l.strip()][-1]
    rows = []
    for path in a.results:
        for line in open(path):
            if line.strip():
                r = json.loads(line)
                if r["variant"].startswith("forward_backward"):
                    r["baseline"] = base["variant"]
                    r["speedup_vs_baseline"] = base["median_ms"] / r["median_ms"]
                rows.append(r)
    json.dump({"note": a.note, "baseline": base, "results": rows}, open(a.out, "w"), indent=1)
    print(json.dumps({r["recipe"] + ":" + r["variant"]: round(r["median_ms"], 1) for r in rows}))


if __name__ == "__main__":
    main()
