#!/usr/bin/env python3
"""The node benchmark in real vLLM 0.26 (issue 34, item 1): E engines, each its own process,
behind a router, with the KV offload arms the node could run, the agentic conversations
interleaved across engines, and one engine restarted mid-run.

  python3 benches/node.py --quick [--out DIR]        # ~8 min on one H200 (below)
  python3 benches/node.py --dry-run [--quick]         # the workload and the tables' shape; no vLLM
  python3 benches/node.py --report DIR [DIR ...]      # one table from the node-E*-*.json of runs
  (on the GPU host: scripts/device-vllm.sh run node --quick)

Engines. ``--engines 2,4``: E ``vllm.LLM`` processes (``benches/node_engine.py``), the
engine core inside each (``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Where E is above the GPUs,
engines share GPUs round-robin and split each one's memory: ``gpu_memory_utilization`` =
``--gpu-mem`` / engines on it, the KV cache fixed by ``num_gpu_blocks_override`` and
``kv_cache_memory_bytes`` (vLLM then does not size the cache from its memory profile, which
another process allocating on the same GPU would confuse). Engines are spawned together (imports overlap) and
built one at a time (``--parallel-build`` builds them together). Each gets one short fresh
prompt before traffic (a readiness probe), as does a restarted one.

Arms, the same CPU memory in total (``--cpu-gib``): ``none`` (recompute); ``offload``, vLLM's
OffloadingConnector in every engine with ``--cpu-gib``/E each; ``lmcache``, one LMCache MP
server for the node (``lmcache server --l1-size-gb``, vLLM's in-tree ``LMCacheMPConnector``;
installed by ``scripts/device-vllm.sh lmcache``, else the arm is reported skipped); ``kvd``,
one ``kvd serve --l1-size-gb`` for the node. kvd's and LMCache's chunk is 256 / scale tokens.

Workload. ``--conversations`` users, user i replaying the main conversation of the i-th trace
of ``benches/traces/engine`` (``engine.py``'s order), its first ``--turns`` turns, closed
loop, all users at once: the node's concurrency is the user count. Prompts are the traces'
hash ids made token ids (``--token-scale``: 64 / scale tokens per trace block); each cell
salts the ids, so no cell hits what another stored, and every arm replays the same tokens.
Cells per E and arm: one per ``--routers`` (``node_router.py``: round-robin, least-loaded,
random, sticky), then the restart cell (``--restart``): turns before ``--restart-turn`` with every
engine up (sticky), the last engine stopped and a new one started in its place (traffic
paused: only the swap is measured), the rest of the turns. The replacement's first turn of
each of its conversations is compared with the same turn on the same engine in the sticky
cell (its steady state) and with the other engines' same turn after the swap. Every
conversation resumes at once after the swap, where in the sticky cell each turn comes when its
conversation's last one ended; ``--restart-control`` runs the same two phases first with no
engine replaced (``--restart-control-pause`` holding traffic between them), the steady state
under the same burst.

Reported per E, arm and router: throughput ((prompt + generated) tokens / wall), TTFT p50/p99
(from the router handing a request over to its first token; ``node_engine.py``), prompt tokens
by source summed over the engines (``vllm:prompt_tokens_by_source``: GPU prefix cache, the
connector, computed), the share of turns that ran on another engine than the conversation's
last turn, greedy tokens differing from the none arm's (informative: batch shapes differ);
engine spawn-to-ready and ``LLM()`` build time; kvd's copy rate (``kvd_bytes_*_total`` over
``kvd_copy_duration_seconds``' sum, per direction; that time includes each job's wait for
the engine's event, so the rate is a floor) against the link's ceiling (pinned host <-> GPU 0
copies of 1 GiB with torch, measured first). Written to ``--out``:
``node.json``, ``node.md``, ``node-E{E}-{arm}.json`` per arm (what ``--report`` merges), and
every engine's and server's log.

Rounds. ``--repeats R`` runs every arm R times per E, the order reversed each round (``schedule``):
a cell lasts seconds, and two runs of session 15 moved ±20% with the arms' order alone, so
one round cannot show a difference of a few percent. The report gives each cell's median and
spread over the rounds. ``--passes P`` runs each router's cell P times on one start of the
arm's engines, each pass with its own salt (nothing one pass stored is hit by the next, but
the pools carry what earlier passes left, as a node's would): P samples for one engine start
(~40-50 s an arm), and the goal table gives kvd's ratio in each (run, pass) beside the median.

Time. ``--budget-s`` caps the whole call; each arm gets an equal share of what is left when
it starts (a cell's first pass and the restart may borrow from the arms still to come, down to
90 s each, so an arm whose engines were slow to start still gives one sample and its restart); a
cell or restart that would not fit is reported skipped, never dropped; each cell has
``--cell-timeout``. ``--quick``: E=2, arms
none,offload,lmcache,kvd, round-robin and sticky, the restart, 8 users x 5 turns, budget 520 s —
about 110 s an arm on the H200 (spawn + import ~15 s, two builds of the 8B shape ~8 s each,
cells ~10 s, the restart ~40 s).
``--full``: E=2,4, round-robin, least-loaded and sticky, 16 users x 8 turns; it does not fit
one device call:
run it an E and two arms per call (``--engines 2 --arms none,offload``, then
``lmcache,kvd``; the same for 4), three times each, then ``--report`` over the outputs.
The 70B shape (``--model benches/models/llama70b --quantization fp8``, 320 KiB of KV a token)
is one engine per GPU: ``--engines 2`` on a 2-GPU host; on one GPU only ``--engines 1``. It fits
an H100 at ``--gpu-blocks 1024 --gpu-mem 0.97`` (67.7 GiB of weights); an engine is ready in
~30 s (the OffloadingConnector's ~50 s; a machine's first engine start 83 s), a sticky:8 cell
of 8 x 5 turns takes 13-29 s an arm (session 37).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import signal
import subprocess
import sys
import time
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import agentic_trace as at  # noqa: E402
import engine as one_engine  # noqa: E402
import node_report as report  # noqa: E402
import node_router as nr  # noqa: E402
import vllm_harness as vh  # noqa: E402
from node_arms import ARMS, Kvd, make_arm, measure_link, warm_group  # noqa: E402
from node_engine import BLOCK, EngineError, EngineProc, kv_bytes_per_token  # noqa: E402

MODEL_8B = os.path.join(HERE, "models", "llama8b")
QUICK = {"engines": "2", "arms": "none,offload,lmcache,kvd", "routers": "round-robin,sticky", "conversations": 8,
         "turns": 5, "budget_s": 520.0}
FULL = {"engines": "2,4", "arms": "none,offload,lmcache,kvd", "routers": "round-robin,least-loaded,sticky",
        "conversations": 16, "turns": 8, "budget_s": 560.0}
DEFAULTS = {"engines": "2", "arms": "none,offload,lmcache,kvd", "routers": "round-robin,sticky", "conversations": 8,
            "turns": 5, "budget_s": 520.0}
PROBE_TOKENS = 256  # the readiness probe's prompt, by default
ARM_FLOOR_S = 90.0  # the least an arm is given: start and one cell
# What one arm with the restart and its control took on the 8B shape, two engines, one sticky
# cell (sessions 34-35 on an H100): start, cell, control, replacement. A planning floor for
# other shapes, not an estimate of them.
RESTART_ARM_S = {"eager": 90.0, "cudagraphs": 140.0}


# --- the workload ---------------------------------------------------------------------------


def users(convs: list[at.Conversation], salt: str, args: argparse.Namespace, vocab: int) -> list[list[tuple[list[int], int]]]:
    """Per user, its turns as (prompt token ids, output tokens); ``salt`` keeps cells apart."""
    tok = at.Tokens(args.token_scale)
    out = []
    for conv in convs:
        turns = []
        for t in conv.turns[:args.turns]:
            ids, _ = tok.prompt(f"{conv.trace}@{salt}", t)
            turns.append(([int(x) % vocab for x in ids], min(args.max_out, max(1, round(t.tokens_out / args.token_scale)))))
        out.append(turns)
    return out


def cell_spec(cell: str) -> tuple[str, int | None]:
    """A ``--routers`` entry: a policy, or ``policy:N`` for a cell of the first N conversations
    only (the node's concurrency is its user count: ``sticky:1,sticky:4,sticky:16`` on one
    engine is the one-engine ladder)."""
    policy, _, n = cell.partition(":")
    if policy not in nr.POLICIES or (n and not (n.isdigit() and int(n) > 0)):
        raise ValueError(f"--routers: {cell!r} is not a policy ({', '.join(nr.POLICIES)}) or POLICY:USERS")
    return policy, int(n) if n else None


def cell_salt(e: int, router: str, pass_no: int = 1) -> str:
    """The first pass keeps the salt runs before ``--passes`` used; later ones get their own."""
    return f"node-E{e}-{router}" + (f"-pass{pass_no}" if pass_no > 1 else "")


def fresh(seed: int, n: int, vocab: int) -> list[int]:
    r = random.Random(seed)
    return [r.randrange(3, vocab) for _ in range(n)]


def placement(e: int, gpus: int, gpu_mem: float) -> list[tuple[str, float]]:
    """(CUDA_VISIBLE_DEVICES, gpu_memory_utilization) of each engine slot."""
    vis = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()] or [str(i) for i in range(gpus)]
    per_gpu = -(-e // gpus)
    return [(vis[i % gpus], round(gpu_mem / per_gpu, 3)) for i in range(e)]


# --- a node: E engines of one arm -----------------------------------------------------------


class Node:
    """The engines of one arm, by slot; a slot's engine can be replaced (``restart``)."""

    #: The engine program (default ``node_engine.py``; tests put a stand-in for vLLM here).
    program: str | None = None

    def __init__(self, e: int, arm, args: argparse.Namespace, label: str) -> None:
        self.e = e
        self.arm = arm
        self.args = args
        self.label = label
        self.events: queue.Queue = queue.Queue()
        self.engines: dict[int, EngineProc] = {}
        self.places = placement(e, args.gpus, args.gpu_mem)
        self.kv_bytes = args.gpu_blocks * BLOCK * kv_bytes_per_token(args.model)
        self.starts: list[dict] = []
        #: The readiness probes' prompts (``probe``), which a warm leaves out.
        self.probes: set[tuple[int, ...]] = set()

    def cfg(self, slot: int) -> dict:
        llm: dict = {} if self.args.profile_memory else {"kv_cache_memory_bytes": self.kv_bytes}
        if self.args.quantization:
            llm["quantization"] = self.args.quantization
        return {"model": self.args.model, "kv": self.arm.kv(slot, self.e), "gpu_blocks": self.args.gpu_blocks,
                "max_model_len": self.args.max_model_len, "gpu_mem": self.places[slot][1],
                "cudagraphs": self.args.cudagraphs, "llm": llm}

    def spawn(self, slot: int, incarnation: int) -> EngineProc:
        env = dict(self.arm.env(), CUDA_VISIBLE_DEVICES=self.places[slot][0])
        if self.args.step_log:
            env["NODE_STEP_LOG"] = "1"
        log = os.path.join(self.args.out, f"{self.label}-e{slot}.log")
        p = EngineProc(slot, incarnation, self.cfg(slot), self.events, log, env=env, program=self.program)
        self.engines[slot] = p
        return p

    def start(self, timeout_s: float) -> list[dict]:
        """Every engine spawned, then built (one at a time unless --parallel-build), then probed."""
        deadline = time.monotonic() + timeout_s
        procs = [self.spawn(s, 0) for s in range(self.e)]
        info = []
        for p in procs:
            p.wait_imported(max(1.0, deadline - time.monotonic()))
        if self.args.parallel_build:
            for p in procs:
                p.request_build()
        for p in procs:
            ready = p.build(max(1.0, deadline - time.monotonic()))
            info.append(self._started(p, ready))
        for p in procs:
            info[p.slot]["probe_s"] = self.probe(p, max(1.0, deadline - time.monotonic()))
        self.starts += info
        return info

    def _started(self, p: EngineProc, ready: dict) -> dict:
        d = {"slot": p.slot, "incarnation": p.incarnation, "gpu": self.places[p.slot][0], "gpu_mem": self.places[p.slot][1],
             "import_s": p.imported_s, "build_s": ready.get("build_s"), "spawn_to_ready_s": round(time.monotonic() - p.spawned, 2),
             "vllm": ready.get("vllm"), "scheduler": ready.get("scheduler")}
        print(f"# {self.label} engine {p.slot}.{p.incarnation} on GPU {d['gpu']}: imported in {d['import_s']} s, "
              f"LLM() built in {d['build_s']} s, ready {d['spawn_to_ready_s']} s after spawn", flush=True)
        return d

    def probe(self, p: EngineProc, timeout_s: float) -> float:
        """One fresh prompt through the engine (``--probe-tokens``, short by default), as a
        readiness probe that generates would."""
        t0 = time.monotonic()
        rid = f"probe/{p.slot}/{p.incarnation}"
        tokens = fresh(zlib.crc32(rid.encode()), self.args.probe_tokens, self.args.vocab)
        self.probes.add(tuple(tokens))
        p.submit(rid, tokens, 2)
        self._answered(p, {rid}, t0 + min(timeout_s, 180.0), "probe")
        return round(time.monotonic() - t0, 2)

    def _answered(self, p: EngineProc, rids: set[str], deadline: float, what: str) -> None:
        """Returns once engine ``p`` has answered every request in ``rids`` (a set it empties);
        an error if it exits or ``deadline`` (monotonic) passes first."""
        while rids and time.monotonic() < deadline:
            try:
                slot, inc, ev = self.events.get(timeout=1.0)
            except queue.Empty:
                continue
            rids.discard(ev.get("id"))
            if ev.get("ev") == "exit" and slot == p.slot and inc == p.incarnation:
                raise EngineError(f"engine {p.slot} exited during its {what} (log {p.log_path}): {p.tail(6)}")
        if rids:
            raise EngineError(f"engine {p.slot}: the {what} did not finish in time, {len(rids)} request(s) "
                              f"unanswered (log {p.log_path})")

    def restart(self, slot: int, timeout_s: float, warm_prompts: int = 0) -> dict:
        """The engine in ``slot`` stopped (its GPU memory freed), a new one started and probed,
        and with ``warm_prompts`` warmed from kvd before traffic returns (``--warm``)."""
        old = self.engines[slot]
        t0 = time.monotonic()
        rc = old.stop()
        stopped = time.monotonic() - t0
        p = self.spawn(slot, old.incarnation + 1)
        p.wait_imported(timeout_s)
        info = self._started(p, p.build(max(1.0, timeout_s - (time.monotonic() - t0))))
        info["probe_s"] = self.probe(p, max(1.0, timeout_s - (time.monotonic() - t0)))
        if warm_prompts:
            info["warm"] = self.warm(p, warm_prompts, max(1.0, timeout_s - (time.monotonic() - t0)))
        info.update({"stop_s": round(stopped, 2), "stop_rc": rc, "down_s": round(time.monotonic() - t0, 2)})
        self.starts.append(info)
        return info

    def warm(self, p: EngineProc, prompts: int, timeout_s: float) -> dict:
        """What ``python -m kvd.warm`` does for a replacement, through this bench's engine
        protocol instead of HTTP: the newest ``prompts`` prompts kvd remembered for the slot
        (within 90% of the engine's GPU cache), oldest first, ``--warm-tokens`` tokens each and
        marked as a warm's (``kv_transfer_params``); returns once all are answered."""
        from kvd.warm import WARM_PARAM, WarmFailed, recall

        t0 = time.monotonic()
        try:
            # The probes this bench sent (fresh prompts, remembered like any other) are no
            # conversation's: asked for beyond the conversations and left out.
            chosen = [c for c in recall(self.arm.server.url, warm_group(p.slot), max_prompts=prompts + len(self.probes),
                                        max_tokens=int(self.args.gpu_blocks * BLOCK * 0.9))
                      if tuple(c.tokens) not in self.probes][:prompts]
        except WarmFailed as e:
            raise EngineError(f"engine {p.slot}: the warm could not recall from kvd: {e}") from e
        left = set()
        for i, pr in enumerate(reversed(chosen)):
            rid = f"warm/{p.slot}/{p.incarnation}/{i}"
            p.submit(rid, pr.tokens, self.args.warm_tokens, {WARM_PARAM: True})
            left.add(rid)
        self._answered(p, left, t0 + timeout_s, "warm")
        out = {"prompts": len(chosen), "tokens": sum(len(c.tokens) for c in chosen), "s": round(time.monotonic() - t0, 2),
               "output_tokens": self.args.warm_tokens}
        print(f"# {self.label} engine {p.slot}.{p.incarnation} warmed from kvd: {out['prompts']} prompts, "
              f"{out['tokens']} tokens in {out['s']} s", flush=True)
        return out

    def metrics(self) -> dict[int, dict[str, float]]:
        return {s: p.metrics() for s, p in self.engines.items()}

    def stop(self) -> None:
        for p in self.engines.values():
            try:
                p.stop(grace_s=10.0)
            except Exception as e:
                print(f"# {self.label}: stopping engine {p.slot}: {e!r}", flush=True)


def sources(m1: dict[int, dict], m0: dict[int, dict], slots=None) -> dict[str, float]:
    tot = {"local_cache_hit": 0.0, "external_kv_transfer": 0.0, "local_compute": 0.0}
    for s, m in m1.items():
        if slots is not None and s not in slots:
            continue
        d = vh.diff(vh.prompt_sources(m), vh.prompt_sources(m0.get(s, {})))
        for k in tot:
            tot[k] += d.get(k, 0.0)
    return tot


def loop_delta(m1: dict[int, dict], m0: dict[int, dict]) -> dict[str, float]:
    """The engines' ``bench:`` clocks (``node_engine.Clock``) over a cell, summed: steps, step
    seconds, seconds in each kvd connector hook, lookups answered "ask again"."""
    out: dict[str, float] = {}
    for s, m in m1.items():
        for k, v in m.items():
            if k.startswith("bench:"):
                out[k[6:]] = round(out.get(k[6:], 0.0) + v - m0.get(s, {}).get(k, 0.0), 6)
    return out


# --- cells ------------------------------------------------------------------------------------


def run_cell(node: Node, router: str, work, timeout_s: float, label: str) -> dict:
    m0, k0 = node.metrics(), node.arm.server_metrics()
    r = nr.Router(cell_spec(router)[0], node.e)
    o = nr.replay(work, range(0, node.args.turns), r, node.engines, node.events, timeout_s, label)
    m1, k1 = node.metrics(), node.arm.server_metrics()
    cell = {"router": router, "label": label, **o.as_dict(), **nr.summarize(o.rows, o.wall_s), "sources": sources(m1, m0)}
    cell["server"] = node.arm.server_delta(k0, k1)
    cell["loop"] = loop_delta(m1, m0)
    print(f"# {node.label} {router}: {o.status}, {len(o.rows)}/{o.requests} in {o.wall_s:.1f} s, "
          f"{report.num(cell['tok_s'])} tok/s, TTFT p50 {report.fmt_s(cell['ttft_p50_s'])} p99 {report.fmt_s(cell['ttft_p99_s'])}, "
          f"{report.source_line(cell['sources'])}, moved {report.pct_s(cell['moved'])}", flush=True)
    return cell


def run_restart(node: Node, work, args: argparse.Namespace, timeout_s: float, label: str, swap: bool = True) -> dict:
    """Turns before --restart-turn, the last slot's engine replaced, the remaining turns. With
    ``swap`` False, the control (``--restart-control``): the same two phases on the same engines
    with nothing replaced, so that every conversation resumes at once as after a restart."""
    t_end = time.monotonic() + timeout_s
    slot = node.e - 1
    k = args.restart_turn
    r = nr.Router("sticky", node.e)
    last: dict = {}
    m0 = node.metrics()
    p1 = nr.replay(work, range(0, k), r, node.engines, node.events, min(args.cell_timeout, t_end - time.monotonic()),
                   label + "/before", last)
    res: dict = {"router": "sticky", "label": label, "slot": slot, "restart_turn": k,
                 "before": {**p1.as_dict(), **nr.summarize(p1.rows, p1.wall_s)}}
    if p1.status != "ok":
        res["status"] = f"before the restart: {p1.status}"
        return res
    m1 = node.metrics()
    res["before"]["sources"] = sources(m1, m0)
    # --warm: the replacement replays the newest prompt of each conversation the router keeps on
    # its slot (an operator's --max-prompts: the replica's sessions).
    warm = sum(1 for s, _ in last.values() if s == slot) if args.warm and isinstance(node.arm, Kvd) else 0
    if not swap:
        t_pause = time.monotonic()
        time.sleep(max(0.0, min(args.restart_control_pause, t_end - time.monotonic() - 10)))
        res["pause_s"] = round(time.monotonic() - t_pause, 2)
    else:
        try:
            res["swap"] = node.restart(slot, max(30.0, t_end - time.monotonic() - 30), warm)
        except EngineError as e:
            res["status"] = f"restart failed: {e}"
            return res
    m1 = node.metrics()  # the replacement's counters start at its probe
    k1 = node.arm.server_metrics()
    p2 = nr.replay(work, range(k, args.turns), r, node.engines, node.events,
                   min(args.cell_timeout, max(10.0, t_end - time.monotonic())), label + "/after", last)
    m2, k2 = node.metrics(), node.arm.server_metrics()
    res["after"] = {**p2.as_dict(), **nr.summarize(p2.rows, p2.wall_s), "sources": sources(m2, m1),
                    "replacement_sources": sources(m2, m1, {slot}), "server": node.arm.server_delta(k1, k2),
                    "replacement_loop": loop_delta({slot: m2.get(slot, {})}, {slot: m1.get(slot, {})})}
    res["status"] = p2.status
    if not swap:
        print(f"# {node.label} restart control (no engine replaced): after: {p2.status}", flush=True)
        return res
    print(f"# {node.label} restart: engine {slot} down {res['swap']['down_s']} s (stop {res['swap']['stop_s']} s, "
          f"import {res['swap']['import_s']} s, build {res['swap']['build_s']} s); after: {p2.status}, replacement "
          f"{report.source_line(res['after']['replacement_sources'])}", flush=True)
    return res


def run_arm(e: int, arm_name: str, args: argparse.Namespace, convs, t_arm_end: float, run_id: str | None = None,
            t_first_end: float = 0.0) -> dict:
    """One arm: its server and engines, each cell's passes, the restart. Pass 1 of a cell, and the
    restart with its control, may run until ``t_first_end`` when that is later than ``t_arm_end``
    (time the arms after this one can spare, down to ARM_FLOOR_S each): an arm whose start ate its
    share (a fresh machine's first build compiles for a minute) still gives one sample of each
    cell and its restart instead of none."""
    label = f"node-E{e}-{arm_name}"
    res: dict = {"engines": e, "arm": arm_name, "label": label, "run": run_id or args.run_id, "sig": report.signature(args),
                 "cells": [], "status": "ok"}
    arm = make_arm(arm_name, args, label)
    res["skip"] = arm.unavailable()
    if res["skip"]:
        res["status"] = f"skipped: {res['skip']}"
        print(f"# {label}: {res['status']}", flush=True)
        return res
    node = Node(e, arm, args, label)
    cells = args.routers.split(",")
    try:
        t0 = time.monotonic()
        res["server_start_s"] = arm.start(e, min(180.0, t_arm_end - time.monotonic()))
        res["kv_transfer_config"] = arm.kv(0, e)
        res["engine_start"] = node.start(min(args.start_timeout, t_arm_end - time.monotonic()))
        res["start_s"] = round(time.monotonic() - t0, 1)
        for router in cells:
            for k in range(1, args.passes + 1):
                left = (max(t_arm_end, t_first_end) if k == 1 else t_arm_end) - time.monotonic()
                if left < args.min_cell_s:
                    res["cells"].append({"router": router, "pass": k, "status": f"skipped: {left:.0f} s of the arm's budget left"})
                    continue
                work = users(convs, cell_salt(e, router, k), args, args.vocab)[:cell_spec(router)[1]]
                name = f"{label}/{router}" + (f"/pass{k}" if args.passes > 1 else "")
                res["cells"].append({**run_cell(node, router, work, min(args.cell_timeout, left - 5), name), "pass": k})
        bad = [c for c in res["cells"] if c.get("status", "ok") != "ok" and not c["status"].startswith("skipped")]
        if bad:
            res["status"] = f"{bad[0]['router']}: {bad[0]['status']}"
        if args.restart and (not args.restart_arms or arm_name in args.restart_arms.split(",")):
            t_restart_end = max(t_arm_end, t_first_end)
            left = t_restart_end - time.monotonic()
            # A replacement's start, the longest cell so far (the two phases make one) and the probe.
            walls = [c["wall_s"] for c in res["cells"] if "wall_s" in c] or [args.min_cell_s]
            need = max(s.get("spawn_to_ready_s") or 0 for s in res["engine_start"]) + max(walls) + 15
            # The control, first: the same phases with no engine replaced (its own prompts).
            need_control = max(walls) + 10 + args.restart_control_pause if args.restart_control else 0
            if left < need + need_control:
                res["restart"] = {"status": f"skipped: {left:.0f} s of the arm's budget left, ~{need + need_control:.0f} s needed"}
            else:
                if args.restart_control:
                    # Whatever the restart does not need: its estimate is a floor, and a first phase
                    # slower than the cells before it must not shorten the pause.
                    c = run_restart(node, users(convs, cell_salt(e, "restart-control"), args, args.vocab), args,
                                    left - need, f"{label}/restart-control", swap=False)
                    res["restart_control"] = c
                    left = t_restart_end - time.monotonic()
                    if c["status"] != "ok":
                        res["status"] = f"restart control: {c['status']}"
                        res["restart"] = {"status": "skipped: the control did not finish"}
                    elif left < need:
                        res["restart"] = {"status": f"skipped: {left:.0f} s of the arm's budget left after the control, "
                                                    f"~{need:.0f} s needed"}
                if "restart" not in res:
                    res["restart"] = run_restart(node, users(convs, cell_salt(e, "restart"), args, args.vocab), args, left - 5,
                                                 f"{label}/restart")
    except KeyboardInterrupt:
        res["status"] = "interrupted (SIGTERM): the cells before it ran"
        res["interrupted"] = True
    except Exception as ex:  # an arm that fails is reported; the next one runs
        import traceback

        traceback.print_exc()
        res["status"] = f"error: {type(ex).__name__}: {str(ex).strip()[:500]}"
        print(f"# {label}: {res['status']}", flush=True)
    finally:
        node.stop()
        res["server_log_tail"] = arm.stop()
        res["engine_starts"] = node.starts
    return res


def _interrupted(signum, frame) -> None:
    """SIGTERM (an outer timeout): stop the engines and write the tables of what ran."""
    raise KeyboardInterrupt()


def schedule(es: list[int], arms: list[str], repeats: int, run_id: str) -> list[tuple[int, str, str]]:
    """(E, arm, run id) in the order they run: per E, ``repeats`` rounds of every arm, the
    order reversed each round (A B, B A, ...). One engine pair's cell lasts seconds and moves
    by ±20% from one arm to the next for reasons of the machine, not the arm (session 15's
    two runs: whichever arm ran first had steps ~18% slower, the sign flipping with the
    order); alternating puts each arm first as often as last, and the report's spread says
    how far the rounds went apart."""
    out = []
    for e in es:
        for k in range(repeats):
            for a in (arms if k % 2 == 0 else arms[::-1]):
                out.append((e, a, run_id if repeats == 1 else f"{run_id}-r{k + 1}"))
    return out


def restart_plan(args: argparse.Namespace, todo: list[tuple[int, str, str]]) -> str | None:
    """A warning, before any engine starts, when the arms that run the restart get less of the
    budget than a restart with its control has needed: such a call finds out only after its
    engines start, and skips every restart (session 35: 88 s a repeat with CUDA graphs, ~140 s
    needed)."""
    if not (args.restart and args.restart_control and args.budget_s and todo):
        return None  # measured only with the control
    restarting = sum(1 for _, a, _ in todo if not args.restart_arms or a in args.restart_arms.split(","))
    if not restarting:
        return None
    share = args.budget_s / len(todo)
    mode = "cudagraphs" if args.cudagraphs else "eager"
    need = RESTART_ARM_S[mode]
    if share >= need:
        return None
    repeats_fit = int(args.budget_s // (need * len(todo) / args.repeats))
    fix = f"raise --budget-s to {need * len(todo):.0f}"
    if restarting == len(todo) and 1 <= repeats_fit < args.repeats:
        fix = f"lower --repeats to {repeats_fit} or {fix}"
    return (f"# warning: {share:.0f} s a run of an arm ({args.budget_s:.0f} s over {len(todo)}), under the ~{need:.0f} s "
            f"a restart with its control has taken ({mode}, the 8B shape on two engines): the restarts will "
            f"likely be skipped; {fix}")


# --- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="E=2, four arms, round-robin + sticky, restart, 8 x 5 turns, 520 s")
    ap.add_argument("--full", action="store_true", help="E=2,4, three routers, 16 x 8 turns (split it over calls)")
    ap.add_argument("--engines", help="comma list of E (default 2)")
    ap.add_argument("--arms", help=f"comma list of {', '.join(ARMS)}")
    ap.add_argument("--routers", help=f"comma list of {', '.join(nr.POLICIES)}, each optionally :USERS (a cell of that many)")
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--budget-s", type=float, help="the whole call (arms share it)")
    ap.add_argument("--repeats", type=int, default=1, help="rounds of every arm, the order reversed each round")
    ap.add_argument("--passes", type=int, default=1,
                    help="each router's cell this many times on the same engines, each pass with its own tokens")
    ap.add_argument("--no-restart", dest="restart", action="store_false")
    ap.add_argument("--restart-arms", default="", help="comma list of the arms that run the restart (default: every arm)")
    ap.add_argument("--restart-control", action="store_true",
                    help="before the restart, the same two phases with no engine replaced: every conversation resumes "
                         "at once as after the swap, so the replacement's turns can be read against the same burst")
    ap.add_argument("--restart-control-pause", type=float, default=0.0, metavar="S",
                    help="seconds the control holds traffic between its phases, as the swap does (default: none)")
    ap.add_argument("--warm", action="store_true",
                    help="kvd arm: engines remember prompts (kvd.warm_group, one per slot) and the restart's "
                         "replacement is warmed from kvd before traffic returns (kvd.warm)")
    ap.add_argument("--probe-tokens", type=int, default=PROBE_TOKENS,
                    help="tokens of each engine's readiness probe, a fresh prompt (default %(default)s). A "
                         "replacement's first large prefill comes after it: a probe the size of a resumed turn's "
                         "prefill runs that first on the replacement before traffic returns")
    ap.add_argument("--warm-tokens", type=int, default=1,
                    help="tokens each warm prompt generates (kvd.warm --output-tokens; default %(default)s: "
                         "1 loads the prefix, more also run decode steps with the warm's batch)")
    ap.add_argument("--step-log", action="store_true",
                    help="every engine logs each step (duration, kvd's hooks, Python's collector, the scheduler's "
                         "queues) and each request's arrival and end to its log")
    ap.add_argument("--restart-turn", type=int, default=0, help="turns before the restart (default: 3/5 of --turns)")
    ap.add_argument("--model", default=MODEL_8B)
    ap.add_argument("--quantization", default="", help="e.g. fp8 (the 70B shape)")
    ap.add_argument("--kvd", default=vh.default_kvd())
    ap.add_argument("--kvd-base", default="", help="another kvd binary, run as the arm kvd-base (a change against "
                    "the code before it, in one call)")
    ap.add_argument("--kvd-extra", default="", help="more kv_connector_extra_config for kvd, as JSON")
    ap.add_argument("--kvd-base-extra", default=None,
                    help="the kvd-base arm's kv_connector_extra_config instead of --kvd-extra, as JSON: with "
                         "--kvd-base naming the same binary, one setting against another in one call (e.g. "
                         "'{\"kvd.layout\":\"BLNHC\"}', vLLM 0.26's cross-layer buffer)")
    ap.add_argument("--lmcache-site", default=os.environ.get("LMCACHE_SITE", "/tmp/lmc-site"))
    ap.add_argument("--lmcache-shim", default=os.environ.get("LMCACHE_SHIM", "/tmp/lmc_shim.so"))
    ap.add_argument("--lmcache-workers", type=int, default=0, help="lmcache server --max-gpu-workers (default: E)")
    ap.add_argument("--trace-dir", default=one_engine.TRACE_DIR)
    ap.add_argument("--token-scale", type=int, default=8)
    ap.add_argument("--max-out", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=2048, help="num_gpu_blocks_override of each engine (16 tokens a block)")
    ap.add_argument("--cpu-gib", type=float, default=16.0, help="CPU memory of each arm, all engines together")
    ap.add_argument("--gpu-mem", type=float, default=0.9, help="gpu_memory_utilization of a GPU, split among its engines")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs to place engines on (default: all visible)")
    ap.add_argument("--max-model-len", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=240.0, help="all engines of an arm spawned, built and probed")
    ap.add_argument("--cell-timeout", type=float, default=120.0)
    ap.add_argument("--min-cell-s", type=float, default=25.0, help="a cell starts only with this much of its arm's share left")
    ap.add_argument("--parallel-build", action="store_true")
    ap.add_argument("--profile-memory", action="store_true", help="let vLLM profile memory (no kv_cache_memory_bytes)")
    ap.add_argument("--cudagraphs", action="store_true", help="default: enforce_eager")
    ap.add_argument("--no-link", dest="link", action="store_false", help="skip the link measurement")
    ap.add_argument("--run-id", default=time.strftime("%Y%m%d-%H%M%S"))
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), ".device/out"))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--report", nargs="+", metavar="DIR", help="merge node-E*-*.json from these folders into one table")
    return ap.parse_args(argv)


def prepare(args: argparse.Namespace) -> list[at.Conversation]:
    """Fills in the preset and what follows from the model and workload; checks the flags;
    returns the conversations (exits with the flag to fix when something does not fit)."""
    preset = FULL if args.full else QUICK if args.quick else DEFAULTS
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.restart_turn = args.restart_turn or max(1, round(args.turns * 3 / 5))
    args.gpus = args.gpus or (1 if args.dry_run else vh.gpu_count() or 1)
    args.vocab = one_engine.model_vocab(args.model)
    if 64 % args.token_scale or (256 // args.token_scale) % BLOCK:
        sys.exit(f"--token-scale {args.token_scale}: must divide 64 and leave a chunk of whole {BLOCK}-token blocks")
    for a in args.arms.split(","):
        if a not in ARMS:
            sys.exit(f"--arms: unknown {a!r}; known: {', '.join(ARMS)}")
        if a == "kvd-base" and not args.kvd_base:
            sys.exit("--arms kvd-base: name its binary with --kvd-base PATH")
    if args.kvd_base_extra is not None and "kvd-base" not in args.arms.split(","):
        sys.exit("--kvd-base-extra configures the kvd-base arm: add it to --arms")
    # Checked now, not when the arm starts after others have run.
    for flag, value in (("--kvd-extra", args.kvd_extra), ("--kvd-base-extra", args.kvd_base_extra)):
        try:
            if value and not isinstance(json.loads(value), dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            sys.exit(f"{flag} {value!r}: {e}; give a JSON object, e.g. '{{\"kvd.layout\": \"BLNHC\"}}'")
    for rt in args.routers.split(","):
        try:
            _, n = cell_spec(rt)
        except ValueError as e:
            sys.exit(str(e))
        if n and n > args.conversations:
            sys.exit(f"--routers {rt}: more users than --conversations {args.conversations}")
    if args.warm_tokens < 1:
        sys.exit(f"--warm-tokens {args.warm_tokens}: a warm prompt generates at least one token")
    if not 0 < args.restart_turn < args.turns:
        sys.exit(f"--restart-turn {args.restart_turn}: must leave turns on both sides of the restart (--turns {args.turns})")
    convs = one_engine.conversations(args.trace_dir, args.conversations)
    longest = max(len(p) for u in users(convs, "size", args, args.vocab) for p, _ in u)
    if not args.max_model_len:
        args.max_model_len = -(-(longest + args.max_out + 1) // 1024) * 1024
    if args.max_model_len > args.gpu_blocks * BLOCK:
        sys.exit(f"--max-model-len {args.max_model_len} does not fit {args.gpu_blocks} GPU blocks: raise --gpu-blocks")
    if not 1 <= args.probe_tokens < args.max_model_len:
        sys.exit(f"--probe-tokens {args.probe_tokens}: between 1 and the engines' max_model_len ({args.max_model_len})")
    return convs


def main() -> int:
    args = parse_args()
    if args.report:
        md = report.merge(args.report)
        print(md)
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "node-merged.md"), "w") as f:
            f.write(md + "\n")
        return 0
    convs = prepare(args)
    es = [int(x) for x in str(args.engines).split(",") if x]
    arms = [a for a in args.arms.split(",") if a]
    sample = users(convs, "size", args, args.vocab)
    os.makedirs(args.out, exist_ok=True)
    kvpt = kv_bytes_per_token(args.model)
    print(f"# node bench {args.run_id}: E {es}; arms {', '.join(arms)}; routers {args.routers}; restart "
          f"{'after turn ' + str(args.restart_turn) if args.restart else 'off'}; {args.conversations} users x "
          f"{args.turns} turns; token scale {args.token_scale}; model {args.model} ({kvpt >> 10} KiB KV/token"
          f"{', ' + args.quantization if args.quantization else ''}); GPU {args.gpu_blocks} blocks "
          f"({args.gpu_blocks * BLOCK * kvpt / (1 << 30):.1f} GiB) per engine; CPU {args.cpu_gib:g} GiB per arm; "
          f"max_model_len {args.max_model_len}; {args.gpus} GPU(s); budget {args.budget_s:.0f} s", flush=True)
    print(f"# workload per cell: {one_engine.workload_stats(sample)}", flush=True)
    for e in es:
        print(f"# E={e}: engines on (CUDA_VISIBLE_DEVICES, gpu_memory_utilization) {placement(e, args.gpus, args.gpu_mem)}",
              flush=True)
    meta = {"args": {k: v for k, v in vars(args).items() if k != "report"}, "kv_bytes_per_token": kvpt}
    todo = schedule(es, arms, args.repeats, args.run_id)
    warn = restart_plan(args, todo)
    if warn:
        print(warn, flush=True)
    if args.dry_run:
        for e in es:
            for rt in args.routers.split(","):
                policy, n = cell_spec(rt)
                sim = nr.simulate(policy, users(convs, cell_salt(e, rt), args, args.vocab)[:n], e)
                print(f"# E={e} {rt}: requests per engine {sim['requests_per_engine']}, later turns on another engine "
                      f"than the last {report.pct_s(sim['moved'])} (simulated: one request at a time per engine)", flush=True)
        results = [report.dry_result(e, a, args, sample) for e in es for a in arms]
        for r in results:
            print(f"# {r['label']}: kv_transfer_config of engine 0: {json.dumps(r['kv_transfer_config'])}", flush=True)
    else:
        signal.signal(signal.SIGTERM, _interrupted)
        t_end = time.monotonic() + args.budget_s
        meta["link"] = measure_link(args.out) if args.link else None
        print(f"# link (pinned host <-> GPU 0, 1 GiB copies): {json.dumps(meta['link'])}", flush=True)
        results = []
        try:
            for i, (e, a, run_id) in enumerate(todo):
                left = t_end - time.monotonic()
                # An equal share of what is left, but enough for one arm to start and run a cell.
                share = min(left, max(left / (len(todo) - i), ARM_FLOOR_S))
                if left < 45:
                    results.append({"engines": e, "arm": a, "label": f"node-E{e}-{a}", "run": run_id,
                                    "sig": report.signature(args), "cells": [], "status": "not run: the budget is spent"})
                    continue
                # Pass 1 of each cell, and the restart, may borrow from the arms still to come, down to their floor.
                r = run_arm(e, a, args, convs, time.monotonic() + share, run_id, t_end - ARM_FLOOR_S * (len(todo) - i - 1))
                results.append(r)
                name = r["label"] + (run_id[len(args.run_id):] if args.repeats > 1 else "")
                with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                    json.dump({"meta": meta, "result": r}, f)
                if r.get("interrupted"):
                    break
        except KeyboardInterrupt:
            print("# interrupted: writing what ran", flush=True)
    md = report.render(results, meta)
    print(md)
    with open(os.path.join(args.out, "node.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "node.json"), "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0 if results and all(r["status"] == "ok" or r["status"].startswith(("dry run", "skipped")) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
