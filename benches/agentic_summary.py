#!/usr/bin/env python3
"""One table from the JSON rows of ``benches/agentic.py --json`` runs (one or more files), for a
before/after at a glance: kvd's hits against MIN's on the same events, per half, pool, geometry
and policy (``POLICY@BINARY`` rows are the other build), with the loss breakdown.

    python3 benches/agentic_summary.py runs-*.jsonl
"""

from __future__ import annotations

import json
import sys


def why(r: dict) -> str:
    """The store refusals' reasons (kvd_store_refusals_total), where the row recorded them."""
    by = r.get("refused_by_reason")
    if by is None:
        return ""
    return f" ({by.get('pinned', 0):.0f} / {by.get('no_pages', 0):.0f})"


def main(paths: list[str]) -> int:
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    rows.sort(key=lambda r: (r["pool_frac"], str(r["traces"]), r["geometry"], r["policy"]))
    print("| pool | half | geometry | --eviction | MIN hits | kvd hits | kvd ÷ MIN | failed loads | refused stores (pinned / no page) | hits reported unpinned | "
          "lost: evicted read / unread, at head | first tenth kvd / MIN | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        x = r.get("loss", {})
        pool = f"{r['pool_frac']}: {100 * r['pool_chunks'] / r['distinct_chunks']:.1f}% ({r['pool_chunks']:,})"
        ratio = r["kvd_hits"] / r["min_hits"] if r["min_hits"] else float("nan")
        print(f"| {pool} | {r['traces']} | {r['geometry']} | {r['policy']} | {100 * r['min_hits'] / max(1, r['min_asked']):.1f}% | "
              f"{100 * r['kvd_hits'] / max(1, r['kvd_asked']):.1f}% | **{ratio:.3f}** | {r['loads_failed']} | {r['refused']:.0f}{why(r)} | "
              f"{r['pin_budget_chunks']:.0f} | {x.get('lost_evicted_read', 0):,} / {x.get('lost_evicted_unread', 0):,}, {x.get('lost_at_head', 0):,} | "
              f"{x.get('first_tenth_kvd_hits', 0):,} / {x.get('first_tenth_min_hits', 0):,} | {r['wall_s']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
