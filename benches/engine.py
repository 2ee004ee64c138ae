#!/usr/bin/env python3
"""The recipes' arms side by side in real vLLM 0.26 on one GPU: the agentic traces replayed with
no offload, vLLM's OffloadingConnector (CPU) and kvd, at a ladder of concurrencies, with the
same GPU KV cache (``num_gpu_blocks_override``) and the same CPU memory for both offload arms.

  PYTHONPATH=/tmp/kvd-site:/tmp/vsite python3 benches/engine.py [--kvd .device/bin/kvd] \
      [--model /tmp/vparts/model] [--arms none,offload,kvd] [--concurrency 1,4,16] [--out DIR]
  python3 benches/engine.py --dry-run      # the workload and the table's shape, no GPU or vLLM

Workload. User i of a concurrency level replays the main conversation of the i-th trace of
``benches/traces/engine/`` (16 traces), its first ``--turns`` turns, closed-loop: the next
turn is sent when the previous one finishes (no think time), so the level's concurrency is the
number of requests in flight. Prompts are the traces' hash ids made token ids (64 / scale tokens
per 64-token trace block, ``agentic_trace.Tokens``; ids folded into the model's vocabulary), so a
turn re-reads its conversation's previous context exactly as the trace says; each level salts
the trace ids, so no level hits what an earlier one stored. Scale: ``--token-scale 8`` makes the
first 12 turns' prompts 1.6k–7.9k tokens (the traces' 13k–63k), and kvd's chunk 256 / 8 = 32
tokens, so kvd sees the chunk sequence of the unscaled trace; output is the trace's answer
length / scale, at most ``--max-out`` tokens (decode is not what is compared). The default
ladder is meant to fit ~6 minutes of GPU time for three arms (``--budget-s 480`` caps it; an engine start
is ~40 s of it per arm); a level that would start after its arm's share of the budget is reported
as skipped, never silently dropped.

Reported per arm and concurrency: throughput (prompt + generated tokens per second of wall
time, and generated tokens per second), TTFT p50/p99 (vLLM's ``first_token_latency``: from the
request's arrival to its first token, queueing included), prompt tokens by source
(``vllm:prompt_tokens_by_source``: GPU prefix cache, the connector, computed), preemptions, and
the GPU time saved: tokens the connector served × the arm's own prefill seconds per token
(measured at start on fresh prompts) — an estimate that prices every token at the calibration
prompt's length — next to the measured difference in wall time against the no-offload arm.
LMCache MP is not an arm of this one-engine bench; it is one of ``benches/node.py``, the node
benchmark (E engines behind a router, one LMCache server for the node, ../shared/lmcache-gpu).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import agentic_trace as at  # noqa: E402
import vllm_harness as vh  # noqa: E402
from node_router import pct  # noqa: E402

TRACE_DIR = os.path.join(HERE, "traces", "engine")
#: The replay order (traces/engine/README.md): smallest largest prompt first.
ORDER = ["0398", "0674", "0624", "0560", "0252", "0716", "0262", "0580",
         "0710", "0099", "0348", "0661", "0570", "0701", "0637", "0365"]
BLOCK = 16
KV_BYTES_PER_TOKEN = 64 << 10  # the model in vllm-gpu/model: 16 layers × 8 heads × 128 × 2 × bf16
ARMS = ("none", "offload", "simple", "kvd")
LMCACHE_NOTE = "LMCache MP: not an arm of this bench; benches/node.py runs it (one server for the node's engines)"


# --- the workload --------------------------------------------------------------------------


def conversations(trace_dir: str, n: int) -> list[at.Conversation]:
    files = at.trace_files(trace_dir)
    rank = {f"trace_{t}.json.gz": i for i, t in enumerate(ORDER)}
    files.sort(key=lambda p: (rank.get(os.path.basename(p), len(rank)), p))
    convs = []
    for p in files:
        main = at.load(p)[0]  # the main conversation; sub-agents are other users' business
        convs.append(main)
        if len(convs) == n:
            break
    if len(convs) < n:
        raise SystemExit(f"{trace_dir} has {len(convs)} traces; concurrency {n} needs {n}")
    return convs


def workload(convs: list[at.Conversation], c: int, args: argparse.Namespace, vocab: int) -> list[list[tuple[list[int], int]]]:
    """Per user, its turns as (prompt token ids, output tokens)."""
    tok = at.Tokens(args.token_scale)
    users = []
    for conv in convs[:c]:
        turns = []
        for t in conv.turns[:args.turns]:
            ids, _ = tok.prompt(f"{conv.trace}@c{c}", t)
            out = min(args.max_out, max(1, round(t.tokens_out / args.token_scale)))
            turns.append(([int(x) % vocab for x in ids], out))
        users.append(turns)
    return users


def workload_stats(users) -> dict:
    prompts = [len(p) for u in users for p, _ in u]
    return {"users": len(users), "requests": len(prompts), "prompt_tokens": sum(prompts),
            "output_tokens": sum(o for u in users for _, o in u), "max_prompt": max(prompts),
            "mean_prompt": round(sum(prompts) / len(prompts))}


def model_vocab(model: str) -> int:
    try:
        with open(os.path.join(model, "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, KeyError, ValueError):
        return 32000


# --- one arm (a child process) ---------------------------------------------------------------



def run_cell(llm, users, timeout_s: float) -> tuple[dict, list[dict]]:
    """The users' turns, closed-loop, until all are done or ``timeout_s`` passes."""
    d = vh.Driver(llm)
    nxt = [0] * len(users)

    def send(u: int) -> None:
        tokens, out = users[u][nxt[u]]
        d.submit(tokens, out, (u, nxt[u]))
        nxt[u] += 1

    def on_finish(f: vh.Finished) -> None:
        u = f.tag[0]
        if nxt[u] < len(users[u]):
            send(u)

    t0 = time.monotonic()
    for u in range(len(users)):
        send(u)
    status = "ok"
    try:
        done = d.run(timeout_s, on_finish=on_finish, label="cell", diagnose=lambda: vh.scheduler_state(llm))
    except vh.Stall as e:
        status, done = f"stalled: {e}", e.done
    wall = time.monotonic() - t0
    rows = [{"user": f.tag[0], "turn": f.tag[1], "prompt": f.prompt_tokens, "cached": f.cached_tokens,
             "out": len(f.token_ids), "ttft_s": f.ttft_s, "e2e_s": round(f.e2e_s, 4)} for f in done]
    return {"status": status, "wall_s": wall}, rows


def calibrate(llm, tokens: int, vocab: int) -> float:
    """Prefill seconds per token on fresh prompts (the best of two, after a warm-up)."""
    import random

    def fresh(seed: int, n: int) -> list[int]:
        r = random.Random(seed)
        return [r.randrange(3, vocab) for _ in range(n)]

    d = vh.Driver(llm)
    d.submit(fresh(7, 512), 2)
    d.run(300, label="warm-up")
    best = None
    for seed in (11, 12):
        d.submit(fresh(seed, tokens), 1)
        f = d.run(120, label="calibration")[0]
        t = f.ttft_s if f.ttft_s else f.e2e_s
        best = t if best is None else min(best, t)
    return best / tokens


def child(args: argparse.Namespace) -> int:
    vh.set_vllm_env()
    arm = args.child
    vocab = model_vocab(args.model)
    levels = [int(x) for x in args.concurrency.split(",")]
    convs = conversations(args.trace_dir, max(levels))
    res: dict = {"arm": arm, "cells": [], "status": "ok"}
    kvd = None

    def save() -> None:
        with open(args.result, "w") as f:
            json.dump(res, f)

    def stalled(label: str) -> None:
        res["status"] = f"stalled (watchdog): {label} never returned from an engine step"
        save()
        if kvd:
            print("# kvd at the stall: " + json.dumps(vh.kvd_summary(kvd.metrics())), flush=True)

    watchdog = vh.Watchdog(stalled)

    try:
        cpu_bytes = int(args.cpu_gib * (1 << 30))
        if arm == "kvd":
            kvd = vh.KvdServer(args.kvd, args.cpu_gib, max(BLOCK, 256 // args.token_scale),
                               os.path.join(args.out, "kvd-engine.log"))
            kvd.start()
        offload_extra = {"block_size": args.offload_block_size} if args.offload_block_size else None
        kv = vh.kv_transfer(arm, kvd_url=kvd.url if kvd else "", cpu_bytes=cpu_bytes,
                            kvd_extra=json.loads(args.kvd_extra) if args.kvd_extra else None, offload_extra=offload_extra)
        res["kv_transfer_config"] = kv
        t0 = time.monotonic()
        watchdog.arm(f"{arm}: engine start", 300)
        llm = vh.make_llm(args.model, kv, gpu_blocks=args.gpu_blocks, max_model_len=args.max_model_len,
                          enforce_eager=not args.cudagraphs)
        watchdog.disarm()
        res["start_s"] = round(time.monotonic() - t0, 1)
        sc = llm.llm_engine.vllm_config.scheduler_config
        res["scheduler"] = {"max_num_seqs": sc.max_num_seqs, "max_num_batched_tokens": sc.max_num_batched_tokens,
                            "async_scheduling": getattr(sc, "async_scheduling", None)}
        import vllm

        res["vllm"] = vllm.__version__
        print(f"# {arm}: engine ready in {res['start_s']} s; scheduler {res['scheduler']}", flush=True)
        watchdog.arm(f"{arm}: calibration", 200)
        res["prefill_s_per_token"] = calibrate(llm, args.calib_tokens, vocab)
        watchdog.disarm()
        print(f"# {arm}: prefill {1 / res['prefill_s_per_token']:.0f} tokens/s on fresh {args.calib_tokens}-token prompts",
              flush=True)
        save()
        for c in levels:
            left = args.deadline - time.time()
            users = workload(convs, c, args, vocab)
            cell: dict = {"concurrency": c, **workload_stats(users)}
            if left < 20:
                cell["status"] = "skipped: the arm's time budget is spent"
                res["cells"].append(cell)
                continue
            m0 = vh.vllm_metrics(llm)
            k0 = kvd.metrics() if kvd else {}
            timeout = min(args.cell_timeout, left - 5)
            watchdog.arm(f"{arm}: concurrency {c}", timeout + 60)
            info, rows = run_cell(llm, users, timeout)
            watchdog.disarm()
            m1 = vh.vllm_metrics(llm)
            src = vh.diff(vh.prompt_sources(m1), vh.prompt_sources(m0))
            ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
            wall = info["wall_s"]
            ptoks = sum(r["prompt"] for r in rows)
            otoks = sum(r["out"] for r in rows)
            cell.update(info)
            cell.update({
                "done": len(rows), "tok_s": (ptoks + otoks) / wall, "out_tok_s": otoks / wall,
                "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99), "e2e_p50_s": pct([r["e2e_s"] for r in rows], 0.5),
                "gpu_hit_tokens": src["local_cache_hit"], "connector_tokens": src["external_kv_transfer"],
                "computed_tokens": src["local_compute"],
                "preemptions": vh.diff(m1, m0).get("vllm:num_preemptions", 0.0),
                "gpu_s_saved_est": src["external_kv_transfer"] * res["prefill_s_per_token"],
                "connector_metrics": {k: v for k, v in vh.diff(vh.connector_metrics(m1), vh.connector_metrics(m0)).items() if v},
                "requests_detail": rows,
            })
            if kvd:
                cell["kvd"] = vh.diff(vh.kvd_summary(kvd.metrics()), vh.kvd_summary(k0))
            res["cells"].append(cell)
            save()
            print(f"# {arm} c={c}: {cell['status']}, {len(rows)}/{cell['requests']} requests in {wall:.1f} s, "
                  f"{cell['tok_s']:.0f} tok/s, TTFT p50 {fmt_s(cell['ttft_p50_s'])} p99 {fmt_s(cell['ttft_p99_s'])}, "
                  f"GPU hit {src['local_cache_hit']:.0f}, connector {src['external_kv_transfer']:.0f}, "
                  f"computed {src['local_compute']:.0f}", flush=True)
            if cell["status"] != "ok":
                res["status"] = cell["status"]
                break
    except Exception as e:
        import traceback

        traceback.print_exc()
        res["status"] = f"error: {type(e).__name__}: {str(e).strip()[:300]}"
    finally:
        watchdog.disarm()
        save()
        if kvd:
            kvd.kill(signal.SIGTERM)
        sys.stdout.flush()
        sys.stderr.flush()
    return 0 if res["status"] == "ok" else 1


# --- the parent: arms in turn, then the table -----------------------------------------------


def fmt_s(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def table(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"Real vLLM {next((r.get('vllm') for r in results if r.get('vllm')), '0.26')} on one GPU, dummy-weight Llama "
        f"(16 layers, 8 KV heads × 128, bf16: 64 KiB KV/token); GPU KV {args.gpu_blocks} blocks of {BLOCK} "
        f"({args.gpu_blocks * BLOCK * KV_BYTES_PER_TOKEN / (1 << 30):.1f} GiB, prefix caching on); CPU for the "
        f"offload arms {args.cpu_gib:g} GiB each; traces {os.path.relpath(args.trace_dir, os.path.dirname(HERE))}, "
        f"{args.turns} turns per user, closed loop, token scale {args.token_scale}, output ≤ {args.max_out} tokens; "
        f"{'eager' if not args.cudagraphs else 'CUDA graphs'}.",
        "",
        "| arm | conc | requests | wall s | tok/s | out tok/s | TTFT p50 | TTFT p99 | GPU hit | connector | computed | preempt | GPU s saved (est.) | vs none: wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    none_wall = {c["concurrency"]: c.get("wall_s") for r in results if r["arm"] == "none" for c in r["cells"] if c.get("status") == "ok"}
    for r in results:
        if not r["cells"]:
            lines.append(f"| {r['arm']} | – | – | – | – | – | – | – | – | – | – | – | – | {r['status']} |")
        for c in r["cells"]:
            if "wall_s" not in c:
                lines.append(f"| {r['arm']} | {c['concurrency']} | {c['requests']} | – | – | – | – | – | – | – | – | – | – | {c.get('status', '')} |")
                continue
            p = max(1.0, c["gpu_hit_tokens"] + c["connector_tokens"] + c["computed_tokens"])
            nw = none_wall.get(c["concurrency"])
            vs = f"{nw - c['wall_s']:+.1f} s ({nw / c['wall_s']:.2f}×)" if nw and r["arm"] != "none" else ""
            status = "" if c["status"] == "ok" else f" **{c['status'][:60]}**"
            lines.append(
                f"| {r['arm']} | {c['concurrency']} | {c['done']}/{c['requests']} | {c['wall_s']:.{1 if c['wall_s'] >= 10 else 2}f} | {c['tok_s']:.0f} | "
                f"{c['out_tok_s']:.0f} | {fmt_s(c['ttft_p50_s'])} | {fmt_s(c['ttft_p99_s'])} | "
                f"{c['gpu_hit_tokens'] / p:.0%} | {c['connector_tokens'] / p:.0%} | {c['computed_tokens'] / p:.0%} | "
                f"{c['preemptions']:.0f} | {c['gpu_s_saved_est']:.2f} | {vs}{status} |")
    lines.append("")
    for r in results:
        extra = []
        if r.get("start_s") is not None:
            extra.append(f"engine start {r['start_s']} s")
        if r.get("prefill_s_per_token"):
            extra.append(f"prefill {1 / r['prefill_s_per_token']:.0f} tokens/s (calibration)")
        for c in r["cells"]:
            if c.get("kvd"):
                k = c["kvd"]
                asked = k["lookup_chunks_hit"] + k["lookup_chunks_miss"]
                extra.append(f"c={c['concurrency']}: kvd retrieved {k['retrieved_gib']:.2f} GiB, stored {k['stored_gib']:.2f} GiB, "
                             f"chunk hit rate {k['lookup_chunks_hit'] / asked:.0%}" if asked else
                             f"c={c['concurrency']}: kvd saw no lookups")
            elif c.get("connector_metrics"):
                extra.append(f"c={c['concurrency']}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(c["connector_metrics"].items())[:6]))
        lines.append(f"- **{r['arm']}** ({r['status']}): " + "; ".join(extra))
    lines.append(f"- {LMCACHE_NOTE}.")
    lines.append("- GPU hit / connector / computed: shares of the prompt tokens by `vllm:prompt_tokens_by_source` "
                 "(counted when a request is first scheduled). GPU s saved (est.): connector tokens × the arm's "
                 "calibrated prefill s/token. vs none: the no-offload arm's wall time minus this arm's, same workload.")
    return "\n".join(lines)


def run_arm(arm: str, args: argparse.Namespace, timeout_s: float) -> dict:
    result = os.path.join(args.out, f"engine-{arm}.json")
    if os.path.exists(result):
        os.remove(result)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", arm, "--result", result,
           "--deadline", str(time.time() + timeout_s - 10)] + [a for a in sys.argv[1:] if a != "--dry-run"]
    env = dict(os.environ, **vh.VLLM_ENV)
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if args.multiproc else "0")
    log_path = os.path.join(args.out, f"engine-{arm}.log")
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        assert p.stdout is not None
        t_end = time.monotonic() + timeout_s
        killer = None
        try:
            import threading

            def kill_group() -> None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

            def reap() -> None:
                # Whatever the arm left holding its stdout (a vLLM worker) must not keep us reading.
                p.wait()
                time.sleep(3)
                kill_group()

            killer = threading.Timer(timeout_s, kill_group)
            killer.start()
            threading.Thread(target=reap, daemon=True).start()
            for line in p.stdout:
                log.write(line)
                if line.startswith(("# ", "STALL", "Traceback")):
                    print(line, end="", flush=True)
                elif "KV Transfer metrics" in line:  # vLLM's log of the connector's own stats
                    print(f"# {arm}: vLLM log: KV Transfer metrics{line.split('KV Transfer metrics', 1)[1].rstrip()}", flush=True)
            p.wait()
        finally:
            if killer:
                killer.cancel()
            kill_group()
    timed_out = time.monotonic() >= t_end
    try:
        with open(result) as f:
            res = json.load(f)
    except (OSError, ValueError):
        res = {"arm": arm, "cells": [], "status": f"no result (exit {p.returncode}; log {log_path})"}
    if timed_out:
        res["status"] = f"killed after {timeout_s:.0f} s (log {log_path})"
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvd", default=vh.default_kvd())
    ap.add_argument("--model", default=vh.default_model())
    ap.add_argument("--arms", default="none,offload,kvd", help=f"comma list of {', '.join(ARMS)} (simple: SimpleCPUOffloadConnector)")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--trace-dir", default=TRACE_DIR)
    ap.add_argument("--turns", type=int, default=12, help="turns per user")
    ap.add_argument("--token-scale", type=int, default=8, help="trace tokens per replayed token (divides 64)")
    ap.add_argument("--max-out", type=int, default=16)
    ap.add_argument("--gpu-blocks", type=int, default=4096, help="num_gpu_blocks_override (16 tokens each)")
    ap.add_argument("--cpu-gib", type=float, default=10.0, help="kvd's pool and the offload arms' cpu_bytes_to_use")
    ap.add_argument("--max-model-len", type=int, default=0, help="default: the longest prompt + --max-out, rounded up")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--offload-block-size", type=int, default=0,
                    help="OffloadingConnector's block_size (tokens per CPU chunk); default: vLLM's (one GPU block)")
    ap.add_argument("--kvd-extra", default="", help="more kv_connector_extra_config for kvd, as JSON")
    ap.add_argument("--budget-s", type=float, default=480.0, help="wall time for all arms together (a cap: ~5 min expected)")
    ap.add_argument("--cell-timeout", type=float, default=120.0)
    ap.add_argument("--multiproc", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=1 (default 0: engine core in-process)")
    ap.add_argument("--cudagraphs", action="store_true", help="default: enforce_eager (engine start in ~40 s)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), ".device/out"))
    ap.add_argument("--dry-run", action="store_true", help="print the workload and an empty table; no vLLM")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if 64 % args.token_scale or (256 // args.token_scale) % BLOCK:
        sys.exit(f"--token-scale {args.token_scale}: must divide 64 and leave kvd a chunk of whole {BLOCK}-token blocks (1, 2, 4, 8, 16)")
    levels = [int(x) for x in args.concurrency.split(",")]
    vocab = model_vocab(args.model)
    convs = conversations(args.trace_dir, max(levels))
    if not args.max_model_len:
        longest = max(len(p) for c in levels for u in workload(convs, c, args, vocab) for p, _ in u)
        args.max_model_len = int(math.ceil((longest + args.max_out + 1) / 1024) * 1024)
        if "--max-model-len" not in sys.argv:
            sys.argv += ["--max-model-len", str(args.max_model_len)]
    if args.max_model_len > args.gpu_blocks * BLOCK:
        sys.exit(f"--max-model-len {args.max_model_len} does not fit {args.gpu_blocks} GPU blocks: raise --gpu-blocks")
    if args.child:
        rc = child(args)
        os._exit(rc)
    os.makedirs(args.out, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS:
            sys.exit(f"--arms: unknown {a!r}; known: {', '.join(ARMS)}")
    print(f"# engine bench: arms {', '.join(arms)}; concurrency {levels}; {args.turns} turns per user; token scale "
          f"{args.token_scale}; GPU {args.gpu_blocks} blocks; CPU {args.cpu_gib:g} GiB; max_model_len {args.max_model_len}", flush=True)
    for c in levels:
        print(f"# c={c}: {workload_stats(workload(convs, c, args, vocab))}", flush=True)
    print(f"# {LMCACHE_NOTE}", flush=True)
    if args.dry_run:
        results = [{"arm": a, "status": "dry run", "cells": [
            {"concurrency": c, **workload_stats(workload(convs, c, args, vocab)), "status": "dry run"} for c in levels]}
            for a in arms]
    else:
        results = []
        t0 = time.monotonic()
        for i, a in enumerate(arms):
            left = args.budget_s - (time.monotonic() - t0)
            share = left / (len(arms) - i)
            if share < 60:
                results.append({"arm": a, "cells": [], "status": "not run: the budget is spent"})
                continue
            results.append(run_arm(a, args, share))
    md = table(results, args)
    print(md)
    with open(os.path.join(args.out, "engine.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(args.out, "engine.json"), "w") as f:
        json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("child", "result", "deadline")},
                   "lmcache": LMCACHE_NOTE, "results": results}, f, indent=1)
    return 0 if all(r["status"] in ("ok", "dry run") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
