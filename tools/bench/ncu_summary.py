"""Sums ncu's per-launch gpu__time_duration by kernel name: a kernel-time breakdown of one run.

Usage: python3 ncu_summary.py NCU.csv [TOP]   (ncu --metrics gpu__time_duration.sum --csv)
"""
import csv
import sys
from collections import defaultdict


def main():
    rows = list(csv.reader(open(sys.argv[1])))
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    cols = rows[head]
    kn, mv, unit = cols.index("Kernel Name"), cols.index("Metric Value"), cols.index("Metric Unit")
    total = defaultdict(float)
    count = defaultdict(int)
    for r in rows[head + 1:]:
        if len(r) <= mv:
            continue
        v = float(r[mv].replace(",", ""))
        v *= {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(r[unit], 1e-6)
        name = r[kn].split("(")[0][:90]
        total[name] += v
        count[name] += 1
    all_ms = sum(total.values())
    print(f"total kernel time {all_ms:.1f} ms over {sum(count.values())} launches")
    for name, ms in sorted(total.items(), key=lambda x: -x[1])[:top]:
        print(f"{ms:9.2f} ms {100 * ms / all_ms:5.1f}% {count[name]:6d}  {name}")


if __name__ == "__main__":
    main()
