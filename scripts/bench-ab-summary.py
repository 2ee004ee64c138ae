#!/usr/bin/env python3
"""One before/after table from the data-plane benchmark's main tables (gpu-check.sh bench-ab).

Usage: bench-ab-summary.py OUT/dataplane-before-1.md OUT/dataplane-after-1.md ...
A file counts as "before" or "after" by its name. For each geometry, layout, request size and
requests in flight it prints every pass's store and retrieve ratio to the same run's ceiling,
and the difference of the means (after - before), so that a change within the passes' own
spread reads as noise.
"""
import re
import sys
from collections import defaultdict


def rows(path):
    for line in open(path, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # The main table: geometry, layout, tokens, in flight, store GB/s, ratio, retrieve GB/s, ratio.
        if len(cells) == 8 and re.fullmatch(r"\d+", cells[2] or "") and re.fullmatch(r"[\d.]+", cells[5] or ""):
            yield tuple(cells[:4]), float(cells[5]), float(cells[7])


def main() -> None:
    runs = defaultdict(lambda: {"before": [], "after": []})
    for path in sys.argv[1:]:
        kind = "before" if "before" in path.rsplit("/", 1)[-1] else "after"
        for key, store, retrieve in rows(path):
            runs[key][kind].append((store, retrieve))
    print("| geometry | layout | tokens | in flight | store before | store after | Δ | retrieve before | retrieve after | Δ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
    for key, r in runs.items():
        cells = []
        for i in (0, 1):
            b = [x[i] for x in r["before"]]
            a = [x[i] for x in r["after"]]
            cells += [", ".join(f"{x:.2f}" for x in b), ", ".join(f"{x:.2f}" for x in a), f"{mean(a) - mean(b):+.3f}"]
        print("| " + " | ".join(key) + " | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
