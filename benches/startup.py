#!/usr/bin/env python3
"""Time from `kvd serve` to /healthz 200 and to a full pool, for one or more kvd binaries in
the same run (so an older binary is the peer). Needs no GPU and no kvd package:

    python3 benches/startup.py --pool-gib 8 --kvd old/kvd --kvd target/release/kvd

Polls /healthz every 10 ms. A kvd without a `pool` field in /healthz (before the pool grew in
the background) is full when it first answers 200.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request


def healthz(http: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://{http}/healthz", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}


def measure(binary: str, gib: float, extra: list[str]) -> tuple[float, float]:
    fd = f"/tmp/kvd-startup-{os.getpid()}.fd.sock"
    t0 = time.perf_counter()
    p = subprocess.Popen([binary, "serve", "--l1-size-gb", str(gib), "--port", "0", "--http-port", "0",
                          "--fd-socket", fd] + extra, stderr=subprocess.PIPE, text=True)
    found = threading.Event()
    http: list[str] = []

    def pump() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            m = re.search(r"serving /healthz and /metrics on http://(\S+)", line)
            if m:
                http.append(m.group(1))
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not found.wait(30):
            raise RuntimeError(f"{binary} did not start")
        serving = full = None
        while full is None:
            code, body = healthz(http[0])
            now = time.perf_counter() - t0
            if code == 200:
                serving = serving or now
                pool = body.get("pool")
                if pool is None or pool.get("state") == "full":
                    full = now
            if p.poll() is not None:
                raise RuntimeError(f"{binary} exited")
            time.sleep(0.01)
        return serving, full
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd", action="append", required=True, help="a kvd binary (repeat to compare)")
    ap.add_argument("--pool-gib", type=float, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kvd-args", default="", help="extra kvd serve flags")
    args = ap.parse_args()
    print(f"# {os.cpu_count()} CPUs, pool {args.pool_gib} GiB, {time.strftime('%Y-%m-%d %H:%M')}, flags {args.kvd_args!r}")
    print("| kvd | run | healthz 200 (s) | pool full (s) |")
    print("|---|---|---|---|")
    for r in range(args.runs):
        for b in args.kvd:
            serving, full = measure(b, args.pool_gib, args.kvd_args.split())
            print(f"| {b} | {r + 1} | {serving:.2f} | {full:.2f} |", flush=True)


if __name__ == "__main__":
    main()
