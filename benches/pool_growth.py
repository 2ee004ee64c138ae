#!/usr/bin/env python3
"""Ready in seconds at any pool size (issue 13 item 5): time to first hit, time to a full pool,
and copy throughput while the pool grows, against the same run's throughput once it is full.

Runs on a GPU host with torch and the kvd wheel installed, against a kvd it starts itself; the
pool must fit in the host's memory (180 GiB needs the two-GPU host):

    python3 benches/pool_growth.py --kvd .device/bin/kvd --pool-gib 180

It starts kvd, polls /healthz every 10 ms until it answers 200 (serving), registers a
Llama-3.1-8B-shaped BLNHC cache, stores 8 requests of 2048 tokens and looks them up (first
hit), then alternates store and retrieve runs of --seconds each (8 requests in flight) while
the pool grows and for as many runs after it is full; figures go to benches/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from dataplane import CHUNK, GEOMETRIES, Cache, ceilings  # noqa: E402
from kvd import _native  # noqa: E402

GIB = 1 << 30


def healthz(http: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{http}/healthz", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return 0, {}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd", required=True)
    ap.add_argument("--pool-gib", type=float, default=180)
    ap.add_argument("--populate-threads", type=int, default=None)
    ap.add_argument("--seconds", type=float, default=0.5, help="length of one store or retrieve run")
    ap.add_argument("--kvd-log", default=None)
    args = ap.parse_args()
    torch.cuda.init()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"{os.cpu_count()} CPUs, pool {args.pool_gib} GiB")
    ceil = ceilings()
    torch.cuda.empty_cache()
    print(f"# ceilings (contiguous 4 GiB pinned copies): d2h {ceil['d2h']:.1f} GB/s, h2d {ceil['h2d']:.1f} GB/s")

    fd = f"/tmp/kvd-growth-{os.getpid()}.fd.sock"
    cmd = [args.kvd, "serve", "--l1-size-gb", str(args.pool_gib), "--port", "0", "--http-port", "0",
           "--fd-socket", fd, "--chunk-tokens", str(CHUNK)]
    if args.populate_threads:
        cmd += ["--populate-threads", str(args.populate_threads)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    found: dict[str, str] = {}
    log = open(args.kvd_log, "w") if args.kvd_log else None
    bound = threading.Event()

    def pump() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if log:
                log.write(line)
                log.flush()
            for key, pat in (("url", r"listening for clients on (tcp://\S+)"), ("http", r"serving /healthz and /metrics on http://(\S+)")):
                m = re.search(pat, line)
                if m:
                    found[key] = m.group(1)
            if "url" in found and "http" in found:
                bound.set()
            if "ready in" in line or "L1 pool full" in line or "stopped growing" in line or "ERROR" in line:
                print("# kvd:", line.strip().split("  ")[-1], flush=True)

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not bound.wait(30):
            raise RuntimeError("kvd did not bind its sockets")
        http = found["http"]
        while healthz(http)[0] != 200:
            if proc.poll() is not None:
                raise RuntimeError("kvd exited before serving")
            time.sleep(0.01)
        t_serving = time.perf_counter() - t0
        client = _native.Client(found["url"], "growth", role="tool", request_timeout=60)
        cache = Cache(client, "BLNHC", GEOMETRIES["llama-3.1-8b"], 2048, 8, 77, spin=False)
        cache.prime()
        keys = [cache.keys[0] + c for c in range(cache.chunks)]
        hit, _ = client.lookup(77, 0, [0], keys, pin=False).result(10)
        t_hit = time.perf_counter() - t0
        if hit != cache.chunks:
            raise RuntimeError(f"first lookup hit {hit} of {cache.chunks} chunks")
        _, h = healthz(http)
        ready_at_hit = h.get("pool", {}).get("ready_bytes", 0)

        print("\n| t (s) | pool ready GiB | state | store GB/s | retrieve GB/s |")
        print("|---|---|---|---|---|")
        growing: dict[str, list[float]] = {"store": [], "retrieve": []}
        full: dict[str, list[float]] = {"store": [], "retrieve": []}
        while True:
            _, h = healthz(http)
            pool = h.get("pool", {})
            state = pool.get("state", "?")
            if state != "growing" and len(full["store"]) >= max(3, len(growing["store"])):
                break
            into = growing if state == "growing" else full
            st = cache.run("store", args.seconds)
            rt = cache.run("retrieve", args.seconds)
            into["store"].append(st)
            into["retrieve"].append(rt)
            print(f"| {time.perf_counter() - t0:.1f} | {pool.get('ready_bytes', 0) / GIB:.1f} | {state} | {st:.1f} | {rt:.1f} |", flush=True)
        _, h = healthz(http)
        pool = h.get("pool", {})

        def med(xs: list[float]) -> str:
            return f"{statistics.median(xs):.1f}" if xs else "n/a"

        print(f"\n| pool | serving (healthz 200) | first store+hit | pool full | growth rate | store GB/s growing / full | retrieve GB/s growing / full |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {pool.get('total_bytes', 0) / GIB:.0f} GiB | {t_serving:.2f} s | {t_hit:.2f} s ({ready_at_hit / GIB:.1f} GiB ready) | "
              f"{pool.get('full_after_s', float('nan'))} s | {pool.get('gb_per_s')} GB/s | "
              f"{med(growing['store'])} / {med(full['store'])} (ceiling {ceil['d2h']:.1f}) | "
              f"{med(growing['retrieve'])} / {med(full['retrieve'])} (ceiling {ceil['h2d']:.1f}) |")
        print(f"# medians over {len(growing['store'])} runs while growing and {len(full['store'])} after; "
              f"{args.seconds} s per run, 8 requests of 2048 tokens in flight")
        client.unregister(cache.reg.region)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
