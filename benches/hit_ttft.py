#!/usr/bin/env python3
"""What a kvd hit costs over a GPU prefix hit, and what kvd costs a request with nothing to load,
in real vLLM 0.26 on one GPU (issue 34, item 2). One engine per arm, one after another:

  PYTHONPATH=/tmp/kvd-site:/tmp/vsite python3 benches/hit_ttft.py [--kvd .device/bin/kvd] \
      [--model benches/models/llama8b] [--arms none,kvd-async,kvd] [--prefixes 8] [--rounds 3]

Per arm and round, for each of ``--prefixes`` distinct prompts of ``--prefix-tokens`` tokens
(not a chunk multiple) followed by a fresh 37-token tail:

- cold: the prompt computed from nothing (nothing to load; kvd's arms look it up and store it);
- GPU hit: the prefix again with another tail, found in vLLM's own prefix cache;
- kvd hit (kvd arms): vLLM's prefix cache emptied (``reset_prefix_cache``), the prefix again
  with a third tail: loaded from kvd.

One request at a time (concurrency 1), then the cold case again with four requests at once
(concurrency 4). TTFT is vLLM's own ``first_token_latency`` (arrival to first token). The copy
a kvd hit needs is priced at the link's ceiling, measured in the same run (pinned host memory
to the GPU, 1 GiB, best of five, in a process of its own): the goal is a kvd hit within the
GPU-hit TTFT plus 1.25x that copy time, and cold requests within 2% of the no-connector arm.

Arms: ``none`` (no connector), ``kvd-async`` (``kvd.load_mode`` async: vLLM parks a hit until
its copy is done, the connector before sync loads), ``kvd`` (the default, ``auto``: sync for
this one-group model). Writes ``hit_ttft.json`` and ``hit_ttft.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import vllm_harness as vh  # noqa: E402
from node_arms import measure_link  # noqa: E402
from node_router import pct  # noqa: E402

# kvd: the defaults (on vLLM 0.26 the KV layout left to vLLM); kvd-blnhc: blocks outermost
# (vLLM 0.26's cross-layer buffer), the default there before session 25; kvd-budget: a step's
# synchronous loads capped at 8,192 tokens (one hit here fits it, so it should load as kvd does).
ARMS = {"none": None, "kvd-async": {"kvd.load_mode": "async"}, "kvd": {}, "kvd-blnhc": {"kvd.layout": "BLNHC"},
        "kvd-budget": {"kvd.sync_load_tokens": 8192}}


def kv_bytes_per_token(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    heads = c.get("num_key_value_heads", c["num_attention_heads"])
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * heads * head_dim * 2  # K and V, bf16


def model_vocab(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def run_arm(arm: str, args, prompts: list[list[int]], tails) -> dict:
    kvd = None
    kv = None
    if ARMS[arm] is not None:
        kvd = vh.KvdServer(args.kvd, args.pool_gib, args.chunk, os.path.join(args.out, f"kvd-{arm}.log"))
        kvd.start()
        kv = vh.kv_transfer("kvd", kvd_url=kvd.url, kvd_extra=ARMS[arm])
    t0 = time.monotonic()
    llm = vh.make_llm(args.model, kv, gpu_blocks=args.gpu_blocks, max_model_len=args.prefix_tokens + 512)
    ready = time.monotonic() - t0
    d = vh.Driver(llm)

    def one(tokens: list[int]) -> vh.Finished:
        d.submit(tokens, 1)
        (f,) = d.run(60, label=arm)
        return f

    def settle() -> None:
        # kvd's stores of what was just computed finish within a few steps (vLLM frees the
        # blocks of a finished request once they are done: a delayed free).
        time.sleep(0.05)

    def reset() -> None:
        # vLLM empties its prefix cache only once no block is in use: step until the delayed
        # frees are done.
        for _ in range(400):
            if llm.reset_prefix_cache():
                return
            llm.llm_engine.step()
            time.sleep(0.005)
        raise RuntimeError("vLLM did not empty its prefix cache")

    one(tails(0, 900))  # warm-up: the first request of an engine pays for lazy setup
    out: dict[str, list[float]] = {"cold": [], "gpu_hit": [], "kvd_hit": [], "cold_c4": []}
    hit_tokens: list[int] = []
    for r in range(args.rounds):
        for i, p in enumerate(prompts):
            salt = [100 + r, 200 + i]  # a round's prompts are its own
            pre = salt + p
            f = one(pre + tails(r * 100 + i, 1))
            out["cold"].append(f.ttft_s or f.e2e_s)
            settle()
            f = one(pre + tails(r * 100 + i, 2))
            out["gpu_hit"].append(f.ttft_s or f.e2e_s)
            if kvd is not None:
                settle()
                reset()
                f = one(pre + tails(r * 100 + i, 3))
                out["kvd_hit"].append(f.ttft_s or f.e2e_s)
                hit_tokens.append(f.cached_tokens)
        for k in range(2):
            for j in range(4):
                d.submit(tails(50_000 + r * 10 + k * 4 + j, 4, n=args.prefix_tokens), 1)
            for f in d.run(60, label=arm):
                out["cold_c4"].append(f.ttft_s or f.e2e_s)
    metrics = vh.vllm_metrics(llm)
    srcs = vh.prompt_sources(metrics)
    res = {"arm": arm, "ready_s": round(ready, 1), "ttft_s": out, "cached_tokens_kvd_hit": hit_tokens,
           "prompt_sources": srcs}
    if kvd is not None:
        res["kvd"] = vh.kvd_summary(kvd.metrics())
        kvd.kill()
    return res


def table(results: list[dict], link: dict | None, kv_per_token: int, prefix_tokens: int, chunk: int) -> str:
    gbps = (link or {}).get("h2d_gbps")
    loaded = (prefix_tokens // chunk) * chunk
    copy_ms = loaded * kv_per_token / (gbps * 1e9) * 1e3 if gbps else None
    lines = [f"Link h2d {gbps} GB/s; a kvd hit loads {loaded} tokens ({loaded * kv_per_token / 1e9:.2f} GB): "
             f"{copy_ms:.1f} ms at the ceiling" if copy_ms else "Link not measured", "",
             "| arm | cold c=1 p50 | cold c=4 p50 | GPU hit p50 / p90 | kvd hit p50 / p90 | kvd hit - GPU hit (p50) | goal: <= 1.25x copy |",
             "|---|---|---|---|---|---|---|"]
    none = next((r for r in results if r["arm"] == "none"), None)
    for r in results:
        t = r["ttft_s"]
        ms = lambda xs, q=0.5: pct(xs, q) * 1e3  # noqa: E731
        cold = f"{ms(t['cold']):.1f} ms"
        c4 = f"{ms(t['cold_c4']):.1f} ms"
        if none is not None and r is not none:
            cold += f" ({ms(t['cold']) / ms(none['ttft_s']['cold']):.3f}x none)"
            c4 += f" ({ms(t['cold_c4']) / ms(none['ttft_s']['cold_c4']):.3f}x none)"
        gpu = f"{ms(t['gpu_hit']):.1f} / {ms(t['gpu_hit'], 0.9):.1f} ms"
        if t["kvd_hit"]:
            kh = f"{ms(t['kvd_hit']):.1f} / {ms(t['kvd_hit'], 0.9):.1f} ms"
            extra = ms(t["kvd_hit"]) - ms(t["gpu_hit"])
            goal = ("met" if extra <= 1.25 * copy_ms else "not met") + f" ({extra:.1f} vs {1.25 * copy_ms:.1f} ms)" if copy_ms else "-"
            lines.append(f"| {r['arm']} | {cold} | {c4} | {gpu} | {kh} | {extra:.1f} ms | {goal} |")
        else:
            lines.append(f"| {r['arm']} | {cold} | {c4} | {gpu} | - | - | - |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvd", default=vh.default_kvd())
    ap.add_argument("--model", default=os.path.join(HERE, "models", "llama8b"))
    ap.add_argument("--arms", default="none,kvd-async,kvd")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=6000, help="not a multiple of the chunk")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--pool-gib", type=float, default=16.0)
    ap.add_argument("--gpu-blocks", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(os.path.dirname(HERE), ".device/out"))
    ap.add_argument("--arm-timeout", type=float, default=240.0)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    vh.set_vllm_env()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    rng = random.Random(7)
    vocab = model_vocab(args.model)
    prompts = [[rng.randrange(1000, vocab) for _ in range(args.prefix_tokens)] for _ in range(args.prefixes)]

    def tails(seed: int, which: int, n: int = 37) -> list[int]:
        g = random.Random(seed * 10 + which)
        return [g.randrange(1000, vocab) for _ in range(n)]

    if args.child:  # one arm, in a process of its own: the GPU is whole again for the next
        res = run_arm(args.child, args, prompts, tails)
        with open(os.path.join(args.out, f"hit_ttft-{args.child}.json"), "w") as f:
            json.dump(res, f)
        return 0
    link = measure_link(args.out)
    vh.say(f"# link: {link}")
    results = []
    for arm in args.arms.split(","):
        if arm not in ARMS:
            sys.exit(f"--arms: unknown {arm!r}; known: {', '.join(ARMS)}")
        cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", arm]
        with open(os.path.join(args.out, f"hit_ttft-{arm}.log"), "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.arm_timeout).returncode
        path = os.path.join(args.out, f"hit_ttft-{arm}.json")
        if rc != 0 or not os.path.exists(path):
            vh.say(f"# {arm}: failed (exit {rc}); see hit_ttft-{arm}.log")
            continue
        with open(path) as f:
            res = json.load(f)
        vh.say(f"# {arm}: ready in {res['ready_s']} s; " + ", ".join(
            f"{k} p50 {statistics.median(v) * 1e3:.1f} ms" for k, v in res["ttft_s"].items() if v))
        results.append(res)
    md = table(results, link, kv_bytes_per_token(args.model), args.prefix_tokens, args.chunk)
    print(md, flush=True)
    with open(os.path.join(args.out, "hit_ttft.json"), "w") as f:
        json.dump({"link": link, "args": vars(args), "results": results}, f, indent=1)
    with open(os.path.join(args.out, "hit_ttft.md"), "w") as f:
        f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
