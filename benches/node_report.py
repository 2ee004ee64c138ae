"""The node benchmark's tables (``benches/node.py``): one run's, or several runs' merged from
the ``node-E{E}-{arm}.json`` files they left (``node.py --report DIR ...``).

Tables: throughput and TTFT per E, router and arm with prompt tokens by source; kvd against
the best other arm (issue 34's goals: >= 1.3x throughput, <= 0.75x TTFT p50 under
round-robin); the restart; engine start times; kvd's copy rate against the link. Where several
runs of an arm are merged, a figure is their median and the spread is given beside it.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import statistics
from typing import Any

import node_router as nr

#: What makes runs comparable: the same workload on the same engines.
SIG_KEYS = ("model", "quantization", "cudagraphs", "conversations", "turns", "token_scale", "max_out", "gpu_blocks",
            "cpu_gib", "restart_turn", "trace_dir", "warm", "warm_tokens", "restart_control", "restart_control_pause",
            "probe_tokens")
#: Keys added to SIG_KEYS after runs were recorded, with what those runs did.
SIG_BEFORE = {"cudagraphs": False, "probe_tokens": 256}


def signature(args) -> dict:
    sig = {k: (os.path.basename(str(getattr(args, k))) if k in ("model", "trace_dir") else getattr(args, k, None))
           for k in SIG_KEYS}
    if not sig["warm"]:
        sig["warm_tokens"] = None  # unwarmed runs compare whatever the flag said
    return sig


def fmt_s(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def num(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def pct_s(x: float | None) -> str:
    return "–" if x is None else f"{x:.0%}"


def source_line(src: dict[str, float]) -> str:
    tot = sum(src.values()) or 1.0
    return (f"GPU hit {src.get('local_cache_hit', 0) / tot:.0%}, connector {src.get('external_kv_transfer', 0) / tot:.0%}, "
            f"computed {src.get('local_compute', 0) / tot:.0%}")


def _shares(src: dict[str, float] | None) -> tuple[str, str, str]:
    if not src:
        return "–", "–", "–"
    tot = sum(src.values()) or 1.0
    return tuple(f"{src.get(k, 0) / tot:.0%}" for k in ("local_cache_hit", "external_kv_transfer", "local_compute"))  # type: ignore[return-value]


def dry_result(e: int, arm: str, args, sample) -> dict:
    """What a dry run shows of an arm: its cells' workload and an engine's connector config."""
    from node_arms import make_arm

    a = make_arm(arm, args, f"node-E{e}-{arm}")
    stats = {"requests": sum(len(u) for u in sample), "prompt_tokens": sum(len(p) for u in sample for p, _ in u)}
    cells = [{"router": r, "status": "dry run", **stats} for r in args.routers.split(",")]
    res = {"engines": e, "arm": arm, "label": f"node-E{e}-{arm}", "run": "dry run", "sig": signature(args),
           "cells": cells, "status": "dry run", "kv_transfer_config": a.kv(0, e)}
    if args.restart:
        res["restart"] = {"status": "dry run", "restart_turn": args.restart_turn}
    return res


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _spread(xs: list[float], f=fmt_s) -> str:
    xs = [x for x in xs if x is not None]
    return f" ({f(min(xs))}–{f(max(xs))}, {len(xs)} runs)" if len(xs) > 1 else ""


def _tokens_vs_none(results: list[dict]) -> dict[tuple, tuple[int, int]]:
    """(run, E, router, arm) -> (requests compared, whose greedy tokens differ from the none
    arm's same request). Cells replay the same token ids in every run (the salts are fixed), so
    a none arm of another run of the same workload serves as well."""
    ref: dict[tuple, dict[tuple, list[int]]] = {}
    for r in sorted(results, key=lambda r: str(r.get("run"))):
        if r["arm"] == "none":
            for c in r.get("cells", []):
                if c.get("rows"):
                    ref.setdefault((r["engines"], c.get("router"), c.get("pass", 1)),
                                   {(x["conv"], x["turn"]): x["tokens"] for x in c["rows"]})
    out: dict[tuple, tuple[int, int]] = {}
    for r in results:
        for c in r.get("cells", []):
            base = ref.get((r["engines"], c.get("router"), c.get("pass", 1)))
            if not base or r["arm"] == "none":
                continue
            pairs = [(x["tokens"], base[(x["conv"], x["turn"])]) for x in c.get("rows", []) if (x["conv"], x["turn"]) in base]
            key = (r.get("run"), r["engines"], c.get("router"), r["arm"])
            n, d = out.get(key, (0, 0))
            out[key] = (n + len(pairs), d + sum(a != b for a, b in pairs))
    return out


def render(results: list[dict], meta: dict) -> str:
    a = meta.get("args", {})
    link = meta.get("link") or {}
    kvpt = meta.get("kv_bytes_per_token", 0)
    lines = [
        f"Real vLLM on {a.get('gpus', '?')} GPU(s): E engines (own processes) behind a router; model "
        f"{os.path.basename(str(a.get('model', '?')))}{' ' + a['quantization'] if a.get('quantization') else ''} "
        f"({kvpt >> 10} KiB KV/token), dummy weights, {'CUDA graphs' if a.get('cudagraphs') else 'eager'}; "
        f"{a.get('gpu_blocks')} GPU blocks of 16 per engine; {a.get('cpu_gib')} GiB CPU per arm (offload: split over "
        f"the engines; LMCache and kvd: one server); {a.get('conversations')} agentic conversations x {a.get('turns')} "
        f"turns, all at once, closed loop; token scale {a.get('token_scale')}, output <= {a.get('max_out')} tokens; "
        f"link {link.get('h2d_gbps', '?')} GB/s h2d, {link.get('d2h_gbps', '?')} GB/s d2h (pinned, 1 GiB).",
        "",
        "| E | router | arm | requests | wall s | tok/s | TTFT p50 | TTFT p99 | GPU hit | connector | computed | moved | tokens ≠ none |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    diffs = _tokens_vs_none(results)
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for r in results:
        for c in r.get("cells", []):
            groups.setdefault((r["engines"], c.get("router"), r["arm"]), []).append((r, c))
    for (e, router, arm), rcs in sorted(groups.items(), key=lambda kv: (kv[0][0], _router_order(kv[0][1]), _arm_order(kv[0][2]))):
        done = [(r, c) for r, c in rcs if "wall_s" in c]
        if not done:
            lines.append(f"| {e} | {router} | {arm} | {rcs[0][1].get('requests', '–')} | – | – | – | – | – | – | – | – | "
                         f"{rcs[0][1].get('status', '')[:90]} |")
            continue
        cs = [c for _, c in done]
        d = [diffs.get(k) for k in {(r.get("run"), e, router, arm) for r, _ in done}]
        d = [x for x in d if x]
        src = {k: sum(c["sources"].get(k, 0) for c in cs) for k in ("local_cache_hit", "external_kv_transfer", "local_compute")}
        gpu, conn, comp = _shares(src)
        bad = [c["status"] for c in cs if c["status"] != "ok"]
        lines.append(
            f"| {e} | {router} | {arm} | {sum(c['done'] for c in cs)}/{sum(c['requests'] for c in cs)} | "
            f"{num(_median([c['wall_s'] for c in cs]), 1)} | {num(_median([c['tok_s'] for c in cs]))}"
            f"{_spread([c['tok_s'] for c in cs], num)} | {fmt_s(_median([c['ttft_p50_s'] for c in cs]))}"
            f"{_spread([c['ttft_p50_s'] for c in cs])} | {fmt_s(_median([c['ttft_p99_s'] for c in cs]))} | {gpu} | {conn} | "
            f"{comp} | {pct_s(_median([c['moved'] for c in cs]))} | "
            f"{(str(sum(x[1] for x in d)) + ' of ' + str(sum(x[0] for x in d))) if d else '–'}"
            f"{' **' + bad[0][:60] + '**' if bad else ''} |")
    for r in sorted(results, key=lambda r: (r["engines"], _arm_order(r["arm"]))):
        if not r.get("cells"):
            lines.append(f"| {r['engines']} | – | {r['arm']} | – | – | – | – | – | – | – | – | – | {r['status'][:90]} |")
    dry = all(r.get("status") == "dry run" for r in results)
    for section in (_goals(groups, dry), _restarts(results), _starts(results, dry), _kvd(results, link, dry),
                    _loop(results)):
        if section:
            lines += ["", *section]
    lines.append("")
    lines.append("- TTFT: from the router handing the request to its engine to the first token (queueing in the engine "
                 "included). GPU hit / connector / computed: shares of prompt tokens by `vllm:prompt_tokens_by_source` "
                 "over all engines. moved: turns whose conversation's previous turn ran on another engine. tokens ≠ none: "
                 "requests whose greedy tokens differ from the none arm's same request (informative: batches differ).")
    return "\n".join(lines)


def _router_order(router: str | None) -> int:
    return nr.POLICIES.index(router) if router in nr.POLICIES else len(nr.POLICIES)


def _arm_order(arm: str) -> int:
    order = ["none", "offload", "lmcache", "kvd-base", "kvd"]
    return order.index(arm) if arm in order else len(order)


def _per_sample(groups: dict[tuple, list], e: int, router: str) -> str:
    """kvd against the best other arm in each (run, pass) kvd and another arm ran, as 'throughput
    ratio / TTFT p50 ratio'; empty where there is only one sample (the median column says it)."""
    by: dict[tuple, dict[str, dict]] = {}
    for (e2, r2, arm), rcs in groups.items():
        if (e2, r2) != (e, router):
            continue
        for r, c in rcs:
            if "wall_s" in c and c.get("status") == "ok":
                by.setdefault((str(r.get("run")), c.get("pass", 1)), {})[arm] = c
    out = []
    for key in sorted(by):
        cs = by[key]
        others = [c for a, c in cs.items() if a != "kvd"]
        if "kvd" not in cs or not others:
            continue
        k = cs["kvd"]
        tp = max(c["tok_s"] or 0 for c in others)
        tt = min((c["ttft_p50_s"] for c in others if c["ttft_p50_s"]), default=None)
        out.append(f"{k['tok_s'] / tp:.2f}x / {k['ttft_p50_s'] / tt:.2f}x" if tp and tt and k["tok_s"] and k["ttft_p50_s"]
                   else "–")
    return "; ".join(out) if len(out) > 1 else ""


def _goals(groups: dict[tuple, list], dry: bool = False) -> list[str]:
    out = ["| E | router | kvd tok/s vs best other | kvd TTFT p50 vs best other | best other (tok/s, TTFT) | "
           "each run and pass: tok/s / TTFT p50 |", "|---|---|---|---|---|---|"]
    if dry:
        out += [f"| {e} | {r} | – | – | dry run | |" for e, r in sorted({(e, r) for e, r, _ in groups}, key=str)]
    keys = sorted({(e, r) for e, r, _ in groups}, key=lambda k: (k[0], _router_order(k[1])))
    for e, router in keys:
        med = {}
        for (e2, r2, arm), rcs in groups.items():
            cs = [c for _, c in rcs if "wall_s" in c and c.get("status") == "ok"]
            if (e2, r2) == (e, router) and cs:
                med[arm] = (_median([c["tok_s"] for c in cs]), _median([c["ttft_p50_s"] for c in cs]))
        if "kvd" not in med or len(med) < 2:
            continue
        others = {a: v for a, v in med.items() if a != "kvd"}
        best_tp = max(others.items(), key=lambda kv: kv[1][0] or 0)
        best_ttft = min(others.items(), key=lambda kv: kv[1][1] or float("inf"))
        k_tp, k_ttft = med["kvd"]
        tp = f"{k_tp / best_tp[1][0]:.2f}x ({best_tp[0]})" if k_tp and best_tp[1][0] else "–"
        tt = f"{k_ttft / best_ttft[1][1]:.2f}x ({best_ttft[0]})" if k_ttft and best_ttft[1][1] else "–"
        out.append(f"| {e} | {router} | {tp} | {tt} | {num(best_tp[1][0])} tok/s, {fmt_s(best_ttft[1][1])} | "
                   f"{_per_sample(groups, e, router)} |")
    out.append("- Goal (issue 34), 2 and 4 engines under round-robin: kvd >= 1.3x the best other arm's throughput and "
               "<= 0.75x its TTFT p50. Medians over the runs and passes; the last column compares kvd with the best "
               "other arm of the same run and pass (the same tokens, the pools in the same state).")
    return out if len(out) > 3 else []


def _slot_ttfts(x: dict, slot: int | None, turn: int | None = None) -> list[float]:
    """TTFTs of the after phase of a restart (or its control) on ``slot`` (None: every engine): one
    turn, or all."""
    return [y["ttft_s"] for y in x["after"]["rows"]
            if (slot is None or y["slot"] == slot) and (turn is None or y["turn"] == turn) and y["ttft_s"] is not None]


def _first_step(x: dict, slot: int, turn: int) -> tuple[int, float | None]:
    """How many of the slot's requests of ``turn`` were waiting when the engine began the step
    that took the first of them (the first wakes an idle engine, which steps at once; the rest wait
    for that step), and their TTFT p50 less the queueing: the engine's own time to first token.
    The engine's step count at each arrival says it exactly. Runs from before it was recorded
    (1eaf7d1; sessions 34 and 35 included) count those queued under 5 ms instead, which held there:
    at most 3.0 ms below the cutoff, at least 9.5 ms above it."""
    rows = [y for y in x["after"]["rows"] if y["slot"] == slot and y["turn"] == turn
            and y["ttft_s"] is not None and y.get("queued_s") is not None]
    steps = [y.get("enq_step") for y in rows]
    if rows and None not in steps:
        head = steps.count(min(steps))
    else:
        head = sum(y["queued_s"] < 0.005 for y in rows)
    return head, nr.pct([y["ttft_s"] - y["queued_s"] for y in rows], 0.5)


def _sticky(r: dict) -> dict | None:
    """The arm's first sticky cell that ran: the restart's steady state, turn for turn."""
    return next((c for c in r.get("cells", []) if c.get("router") == "sticky" and c.get("rows")), None)


def _steady_ttfts(r: dict, slot: int, turn: int, later: bool = False) -> list[float] | None:
    """The sticky cell's TTFTs on ``slot`` at ``turn`` (from ``turn`` on with ``later``): the same
    engine's same turns with no restart. None where the arm ran no sticky cell."""
    sticky = _sticky(r)
    if sticky is None:
        return None
    return [y["ttft_s"] for y in sticky["rows"] if y["slot"] == slot and y["ttft_s"] is not None
            and (y["turn"] >= turn if later else y["turn"] == turn)]


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "–"


def _restart_row(r: dict) -> str:
    x = r.get("restart") or {}
    if "after" not in x:
        return f"| {r['engines']} | {r['arm']} | – | – | – | – | – | – | – | – | – | – | {x.get('status', r['status'])[:80]} |"
    slot, k = x["slot"], x["restart_turn"]
    # After the swap every request on the slot is the replacement's.
    first, repl_all = _slot_ttfts(x, slot, k), _slot_ttfts(x, slot)
    others = [y["ttft_s"] for y in x["after"]["rows"] if y["slot"] != slot and y["turn"] == k and y["ttft_s"] is not None]
    # The sticky cell replays the same conversations on the same engines without a restart: the
    # same engine's same turns there are its steady state, turn for turn.
    steady = _steady_ttfts(r, slot, k) or []
    steady_all = _steady_ttfts(r, slot, k, later=True) or []
    base = nr.pct(steady, 0.5) if steady else nr.pct(others, 0.5)
    p_first = nr.pct(first, 0.5)
    ratio = _ratio(p_first, base)
    if not steady and ratio != "–":
        # Not the goal's steady state: the other engines hit their own GPU caches on that turn,
        # where the replacement loads from the connector, and their conversations are others.
        ratio += " of the other engines (no sticky cell: not the goal's steady)"
    p_all, p_steady_all = nr.pct(repl_all, 0.5), nr.pct(steady_all, 0.5)
    ratio_all = _ratio(p_all, p_steady_all) if p_steady_all else "– (no sticky cell)"
    gpu, conn, comp = _shares(x["after"].get("replacement_sources"))
    sw = x["swap"]
    warmed = f" + {sw['warm']['s']} warm: {sw['warm']['prompts']} prompts" if sw.get("warm") else ""
    return (f"| {r['engines']} | {r['arm']} | {sw['down_s']} s ({sw['stop_s']} + {sw['import_s']} + {sw['build_s']} + "
            f"{sw.get('probe_s')}{warmed}) | {fmt_s(p_first)} ({len(first)}) | {fmt_s(nr.pct(steady, 0.5))}"
            f"{'' if steady else ' (no sticky cell)'} | {fmt_s(nr.pct(others, 0.5))} | {ratio} | {fmt_s(p_all)} ({len(repl_all)}) | "
            f"{fmt_s(p_steady_all)} | {ratio_all} | {gpu} / {conn} / {comp} | {x.get('status', '')[:60]} |")


def _control_figures(r: dict) -> dict | None:
    """The control's figures and, where the restart ran after it, the restart's beside them (p50s
    in seconds; None where a side has none)."""
    c, x = r.get("restart_control") or {}, r.get("restart") or {}
    if "after" not in c:
        return None
    slot, k = c["slot"], c["restart_turn"]
    c_first, c_all = _slot_ttfts(c, slot, k), _slot_ttfts(c, slot)
    steady = _steady_ttfts(r, slot, k)
    f: dict = {"first": nr.pct(c_first, 0.5), "n_first": len(c_first), "every": nr.pct(c_all, 0.5), "n_all": len(c_all),
               "steady": nr.pct(steady, 0.5) if steady is not None else None, "restart": "after" in x}
    if f["restart"]:
        (f["c_head"], f["c_eng"]), (f["x_head"], f["x_eng"]) = _first_step(c, slot, k), _first_step(x, slot, k)
        f["rep_first"], f["rep_all"] = nr.pct(_slot_ttfts(x, slot, k), 0.5), nr.pct(_slot_ttfts(x, slot), 0.5)
        # The engines share the GPU: what one gains of it after the resume another may lose.
        f["node_first"] = (nr.pct(_slot_ttfts(x, None, k), 0.5), nr.pct(_slot_ttfts(c, None, k), 0.5))
        f["node_all"] = (nr.pct(_slot_ttfts(x, None), 0.5), nr.pct(_slot_ttfts(c, None), 0.5))
    return f


def _control_row(r: dict) -> str | None:
    c = r.get("restart_control") or {}
    f = _control_figures(r)
    if f is None:
        return f"| {r['engines']} | {r['arm']} | – | – | – | – | – | – | – | – | – | {c.get('status', '')[:80]} |" if c else None
    heads = engine_side = node_first = node_all = "–"
    rep_first = rep_all = None
    if f["restart"]:
        heads, engine_side = f"{f['c_head']} / {f['x_head']}", _ratio(f["x_eng"], f["c_eng"])
        rep_first, rep_all = f["rep_first"], f["rep_all"]
        node_first, node_all = _ratio(*f["node_first"]), _ratio(*f["node_all"])
    return (f"| {r['engines']} | {r['arm']} | {fmt_s(f['first'])} ({f['n_first']}) | {_ratio(f['first'], f['steady'])} | "
            f"**{_ratio(rep_first, f['first'])}** | {fmt_s(f['every'])} ({f['n_all']}) | {_ratio(rep_all, f['every'])} | "
            f"{heads} | {engine_side} | {node_first} | {node_all} | {c.get('status', '')[:60]} |")


def _control_summary(rs: list[dict]) -> list[str]:
    """One line per engine count and arm over its runs: the replacement's first turn to the
    control's (median, range, within the goal's 1.2x), the same in the engine where both sides'
    first steps took the same number of requests, and every engine's first turn."""
    out = []
    for (e, arm), group in itertools.groupby(rs, key=lambda r: (r["engines"], r["arm"])):
        # Only runs whose control and restart both finished: a timed-out phase leaves partial rows.
        done = [r for r in group if (r.get("restart_control") or {}).get("status") == "ok"
                and (r.get("restart") or {}).get("status") == "ok"]
        fs = [f for f in map(_control_figures, done) if f and f["restart"] and f["rep_first"] and f["first"]]
        if len(fs) < 2:
            continue
        first = [f["rep_first"] / f["first"] for f in fs]
        same = [f["x_eng"] / f["c_eng"] for f in fs if f["x_head"] == f["c_head"] and f["x_eng"] and f["c_eng"]]
        node = [a / b for a, b in (f["node_first"] for f in fs) if a and b]

        def spread(xs: list[float]) -> str:
            return f"median {statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f}x)" if xs else "–"

        out.append(f"- E={e}, {arm}, {len(fs)} restarts: the replacement's first turn to the control {spread(first)}, "
                   f"within 1.2x in {sum(x <= 1.2 for x in first)} of {len(fs)}; in the engine, where both first "
                   f"steps took as many requests ({len(same)} run{'' if len(same) == 1 else 's'}), {spread(same)}, within 1.2x in "
                   f"{sum(x <= 1.2 for x in same)}; every engine's first turn {spread(node)}.")
    return out


def _restarts(results: list[dict]) -> list[str]:
    # A control that ran is reported even if the restart after it did not (an interrupted run).
    rs = sorted((r for r in results if r.get("restart") or r.get("restart_control")),
                key=lambda r: (r["engines"], _arm_order(r["arm"])))
    if not rs:
        return []
    controls = [row for row in map(_control_row, rs) if row]
    control_table = [
        "",
        "| E | arm | no restart (control), same slot, first turn after the resume: TTFT p50 (n) | control to steady | "
        "replacement's first turn to the control | control, same slot, all turns after (n) | replacement's all turns "
        "to the control | first turn's requests in the engine's first step: control / replacement | replacement's "
        "first turn to the control, in the engine (TTFT less queueing) | every engine, first turn: restart to "
        "control | every engine, all turns after: restart to control | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *controls,
        *_control_summary(rs),
        "- Control (`--restart-control`): before the restart, the same two phases on the same engines with no engine "
        "replaced and prompts of its own. Every conversation resumes at once after the first phase, as after the "
        "swap, where in the sticky cell each turn comes when its conversation's last one ended: the control is the "
        "replacement's steady state under the same burst. An engine takes requests between steps: the first of a "
        "resumed turn wakes it and it steps at once, the rest wait for that step (in the first step: those that "
        "arrived before it began, by the engine's step count; in runs before it was recorded, those queued under "
        "5 ms); when more of one side's requests make the first step its p50 drops, and the engine's own time to "
        "first token, queueing left out, compares the two. The last two columns set every engine's TTFT p50 after "
        "the restart against the control's: engines that share a GPU share its time, so what the replacement loses "
        "of it the engines kept may gain."] if controls else []
    return ["| E | arm | down: stop + import + build + probe (+ warm from kvd) | replacement, first turn after: TTFT p50 (n) | "
            "same engine, same turn, sticky cell (steady) | other engines, same turn | first turn to steady | "
            "replacement, all turns after: TTFT p50 (n) | same engine, same turns, sticky cell | all turns to steady | "
            "replacement: GPU hit / connector / computed | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
            *map(_restart_row, rs),
            "- Restart: the last engine stopped after the first turns of every conversation (sticky routing, traffic paused "
            "for the swap) and a new one started in its place; its conversations come back to it. Goal (issue 34): "
            "with kvd the replacement's TTFT p50 within 1.2x of its steady state. Two readings: its first turn "
            "(every conversation reloads its whole prefix at once) and all its turns after the restart, each against "
            "the same engine's same turns in the sticky cell.", *control_table]


def _starts(results: list[dict], dry: bool = False) -> list[str]:
    out = ["| E | arm | server ready | engine: import | LLM() built | spawn to ready | probe |", "|---|---|---|---|---|---|---|"]
    if dry:
        out += [f"| {r['engines']} | {r['arm']} | – | – | – | – | dry run |" for r in results]
    for r in sorted(results, key=lambda r: (r["engines"], _arm_order(r["arm"]))):
        st = [s for s in r.get("engine_starts", []) if s.get("incarnation") == 0]
        if not st:
            continue

        def span(key: str, st: list[dict] = st) -> str:
            xs = [s.get(key) for s in st if s.get(key) is not None]
            return "–" if not xs else f"{min(xs):.1f}" + (f"–{max(xs):.1f}" if max(xs) != min(xs) else "") + " s"

        sv = r.get("server_start_s")
        out.append(f"| {r['engines']} | {r['arm']} | {'–' if sv is None else f'{sv:.1f} s'} | {span('import_s')} | "
                   f"{span('build_s')} | {span('spawn_to_ready_s')} | {span('probe_s')} |")
    return out if len(out) > 2 else []


def _kvd(results: list[dict], link: dict, dry: bool = False) -> list[str]:
    out = ["| E | cell | retrieved GiB | stored GiB | h2d GB/s per copy | d2h GB/s per copy | h2d / link | chunk hit rate "
           "| submitting h2d / d2h (slowest job) |",
           "|---|---|---|---|---|---|---|---|---|"]
    if dry:
        out += [f"| {r['engines']} | {c['router']} | – | – | – | – | – | dry run | – |" for r in results
                if r["arm"] == "kvd" for c in r["cells"]]
    for r in sorted(results, key=lambda r: _arm_order(r["arm"])):
        if r["arm"] not in ("kvd", "kvd-base"):
            continue
        base = " (kvd-base)" if r["arm"] == "kvd-base" else ""
        cells = [(_cell_name(c) + base, c.get("server")) for c in r.get("cells", [])]
        if r.get("restart", {}).get("after"):
            cells.append(("restart (after)", r["restart"]["after"].get("server")))
        for name, k in cells:
            if not k:
                continue
            h2d = k.get("h2d_gbps")
            vs = f"{h2d / link['h2d_gbps']:.0%}" if h2d and link.get("h2d_gbps") else "–"
            out.append(f"| {r['engines']} | {name} | {k['retrieved_gib']:.2f} | {k['stored_gib']:.2f} | {num(h2d, 1)} | "
                       f"{num(k.get('d2h_gbps'), 1)} | {vs} | {pct_s(k.get('chunk_hit_rate'))} | "
                       f"{_submitting(k, 'h2d')} / {_submitting(k, 'd2h')} |")
    return _noted(out, "- kvd's copy rate: bytes over the summed time of its copy jobs from submission to completion "
                  "(`kvd_copy_duration_seconds`), per direction, against the link measured first (pinned host memory <-> "
                  "GPU 0). That time includes each job's wait on the device for the engine's event (a store waits for the "
                  "forward pass that wrote its blocks), so it is a floor on the copies' rate, not their rate: stores "
                  "trickle at the rate the engines compute. Submitting: the copy thread's seconds handing jobs to the "
                  "device (`kvd_copy_submit_duration_seconds`), and the bucket bound of its slowest job. A GPU's stores and "
                  "retrieves are submitted by a thread each (before 2026-12-07, kvd-base in session 38's calls: one "
                  "thread, both directions in order, so a slow store submission delayed the retrieves behind it).")


def _submitting(k: dict, direction: str) -> str:
    """A direction's submit seconds and its slowest job's bound (``node_arms.slowest_bound``)."""
    secs, slowest = k.get(f"{direction}_submit_s"), k.get(f"{direction}_submit_slowest_s")
    if secs is None or slowest is None:  # recorded before the bench read it, or no job that way
        return "–"
    # kvd's last finite bound is 1 µs × 2.5¹³.
    bound = f"> {1e-6 * 2.5 ** 13 * 1e3:.0f} ms" if slowest == float("inf") else f"≤ {slowest * 1e3:.3g} ms"
    return f"{secs:.3f} s ({bound})"


def _loop(results: list[dict]) -> list[str]:
    """Where the engines' time went in each cell (``node_engine.Clock``): steps, their mean, the
    share inside kvd's connector hooks (the three costliest named) and lookups that answered
    "ask again"."""
    out = ["| E | router | arm | steps | ms a step | in kvd's hooks | costliest hooks (ms a step) | ask again "
           "| steps held ≥ 30 / ≥ 100 ms | loads / waited |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["engines"], _arm_order(r["arm"]))):
        for c in r.get("cells", []):
            lp = c.get("loop") or {}
            steps = lp.get("steps", 0.0)
            if not steps:
                continue
            hooks = {k[len("hook_s{hook="):-1]: v for k, v in lp.items() if k.startswith("hook_s{")}
            total = sum(hooks.values())
            top = sorted(hooks.items(), key=lambda kv: -kv[1])[:3]
            share = f"{total / lp['step_s']:.1%}" if hooks and lp.get("step_s") else "–"
            costly = ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in top) or "–"
            again = f"{lp.get('ask_again', 0):.0f}" if hooks else "–"
            held = (f"{lp.get('held{ms=30}', 0):.0f} / {lp.get('held{ms=100}', 0):.0f}"
                    if hooks and "held{ms=30}" in lp else "–")
            loads = (f"{lp.get('loads', 0):.0f} / {lp.get('loads_waited', 0):.0f}"
                     if hooks and "loads" in lp else "–")
            out.append(f"| {r['engines']} | {_cell_name(c)} | {r['arm']} | {steps:.0f} | "
                       f"{1e3 * lp.get('step_s', 0) / steps:.2f} | {share} | {costly} | {again} | {held} | {loads} |")
    return _noted(out, "- Steps: `LLM.llm_engine.step()` calls on each engine's own thread (scheduler, connector and model "
                  "together: the engine core runs in-process), summed over the engines; hooks: seconds inside kvd's "
                  "connector methods; ask again: lookups answered `None`, each holding its request back a step; held: "
                  "steps that spent that long in kvd's hooks (a synchronous load waits there, the whole batch with it); "
                  "loads / waited: loads kvd's scheduler side planned, and of them those whose copy waited for the "
                  "model's stream (`kvd.load_overlap`: the rest started beside the forward pass still on the GPU).")


def _cell_name(c: dict) -> str:
    """A cell's router, and its pass where there were several."""
    return str(c.get("router")) + (f" pass {c['pass']}" if c.get("pass", 1) > 1 else "")


def _noted(table: list[str], note: str) -> list[str]:
    """A table (header and rule first) with its note, or nothing when it has no rows."""
    return table + [note] if len(table) > 2 else []


def load(dirs: list[str]) -> tuple[list[dict], dict]:
    """The arms' results in these folders (the latest of each run, E and arm)."""
    found: dict[tuple, tuple[float, dict, dict]] = {}
    for d in dirs:
        for p in glob.glob(os.path.join(d, "**", "node-E*-*.json"), recursive=True):
            try:
                with open(p) as f:
                    doc = json.load(f)
            except (OSError, ValueError):
                continue
            r: Any = doc.get("result")
            if not isinstance(r, dict):
                continue
            # Runs recorded before a key joined the signature: from their arguments, else what
            # the bench did then.
            if isinstance(r.get("sig"), dict):
                saved = (doc.get("meta") or {}).get("args", {})
                for k, v in SIG_BEFORE.items():
                    r["sig"].setdefault(k, saved.get(k, v))
            key = (r.get("run"), r["engines"], r["arm"])
            mt = os.path.getmtime(p)
            if key not in found or found[key][0] < mt:
                found[key] = (mt, r, doc.get("meta", {}))
    return [v[1] for v in found.values()], next((v[2] for v in found.values()), {})


def merge(dirs: list[str]) -> str:
    results, meta = load(dirs)
    if not results:
        return f"no node-E*-*.json in {', '.join(dirs)}"
    sigs = {json.dumps(r.get("sig"), sort_keys=True) for r in results}
    head = ""
    if len(sigs) > 1:
        first = json.loads(sorted(sigs)[0])
        head = (f"**Note: {len(sigs)} different workloads among these runs; only those of {json.dumps(first)} are "
                "shown.**\n\n")
        results = [r for r in results if json.dumps(r.get("sig"), sort_keys=True) == sorted(sigs)[0]]
    runs = sorted({str(r.get("run")) for r in results})
    return head + f"Runs: {', '.join(runs)}.\n\n" + render(results, meta)
