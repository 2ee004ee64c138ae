#!/usr/bin/env python3
"""A lookup's round trip through the Python client when the threads on both ends have been idle,
against the same lookups back to back. Needs no GPU; needs the kvd package and a kvd binary:

    python3 benches/lookup_latency.py --kvd target/release/kvd

In the engine a lookup comes once a request (vLLM's `get_num_new_matched_tokens`), so every one
finds kvd's server thread, the client's reader thread and the engine's own thread asleep; back to
back (benches/dataplane.py's lookup section) all three stay awake. The gap between the two is
what waking them costs on this machine. Each row also gives the time `lookup()` takes to return
(the request written: the kernel wakes the server inside that write) and the chunk hashes of a
prompt of that many chunks (`kvd._native.chunk_hashes`, the connector's first step; p50 of 51), and the whole call vLLM's
scheduler makes for a new request (`get_num_new_matched_tokens` of the connector's scheduler side:
the hashes of a new prompt, its lookup, the wait for the answer), with the same idle before each:
with kvd's presence filter (the default; kvd certainly lacks the prompt, so the call answers
without waiting for kvd) and with `kvd.presence` off (it waits, as before the filter).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import threading
import time

import kvd._native as native
from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.scheduler import GroupInfo, KvdScheduler, SchedRequest
from node_router import pct


def us(xs: list[float], q: float) -> float:
    """The q-quantile of xs (seconds, never empty here) in µs."""
    return (pct(xs, q) or 0.0) * 1e6


def measure(client: native.Client, hashes: list[int], gap_s: float, n: int) -> tuple[list[float], list[float]]:
    """n lookups of `hashes` (none stored: a miss, as for a prompt's new tail), `gap_s` apart."""
    total, send = [], []
    for _ in range(n):
        if gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        p = client.lookup(1, 0, [0], hashes, pin=True)
        t1 = time.perf_counter()
        hit, pin = p.result(10)
        t2 = time.perf_counter()
        if hit or pin:
            raise SystemExit(f"a lookup of keys never stored answered hit={hit} pin={pin}: is another client storing?")
        total.append(t2 - t0)
        send.append(t1 - t0)
    return total, send


def measure_connector(url: str, chunks: int, gap_s: float, n: int, presence: bool = True) -> tuple[list[float], int]:
    """n calls of the connector's `get_num_new_matched_tokens` (vLLM's scheduler asks it once a
    new request), each for a new request of `chunks` chunks and a token nobody stored: the
    chunk hashes and the lookup of a prompt with nothing to load, as the engine pays them.
    Also gives how many answered "ask again" (no answer within `lookup_wait_s`: in the engine,
    the request waits a step), each then asked again until it answers."""
    cfg = KvdConfig(url=url, presence=presence)
    conn = Connection(cfg, "lookup-latency-connector", "scheduler")
    sched = KvdScheduler(cfg, [GroupInfo(fingerprint=7, block_tokens=16, shards=(0,))], conn)
    took, waits = [], 0
    try:
        for i in range(n):
            if gap_s:
                time.sleep(gap_s)
            req = SchedRequest(f"r{i}", list(range(i, i + chunks * 256 + 1)), chunks * 256 + 1)
            t = time.perf_counter()
            got = sched.get_num_new_matched_tokens(req, 0)
            took.append(time.perf_counter() - t)
            while got[0] is None:
                waits += 1
                time.sleep(0.001)
                sched.build([], [])
                got = sched.get_num_new_matched_tokens(req, 0)
            if got != (0, False):
                raise SystemExit(f"a prompt nobody stored got {got} from the connector: is another client storing?")
            sched.request_finished(req.req_id)
    finally:
        conn.close()  # its reconnect thread too: each row makes one
    return took, waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvd", default="target/release/kvd")
    ap.add_argument("--chunks", default="8,28", help="comma list: chunks a lookup asks for (28 = a 7,168-token prompt)")
    ap.add_argument("--gaps-ms", default="0,2,20", help="comma list: idle time before each lookup (0: back to back)")
    ap.add_argument("--n", type=int, default=200, help="lookups a row (back to back: 5x as many)")
    ap.add_argument("--ipc", action="store_true", help="over ipc:// (a Unix socket) instead of tcp://127.0.0.1")
    args = ap.parse_args()

    sock = f"/tmp/kvd-lookup-latency-{os.getpid()}.sock"
    cmd = [args.kvd, "serve", "--l1-size-gb", "0.25", "--port", "0", "--http-port", "0",
           "--fd-socket", sock + ".fd"]
    if args.ipc:
        cmd += ["--ipc", sock]
    srv = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        assert srv.stderr is not None
        for line in srv.stderr:
            if "tcp://" in line and "listening" in line:
                port = line.split("tcp://", 1)[1].split()[0].rstrip(",")
                break
        if port is None:
            raise SystemExit(f"kvd did not say where it listens (exit {srv.poll()})")
        # Keep reading its log, so that a full pipe never stalls it.
        log = srv.stderr
        threading.Thread(target=lambda: [None for _ in log], daemon=True).start()
        url = f"ipc://{sock}" if args.ipc else f"tcp://{port}"
        client = native.Client(url, "lookup-latency", role="scheduler")
        print(f"kvd {args.kvd} at {url}; {os.cpu_count()} CPUs; p50 / p90 of {args.n} lookups a row (back to back: {5 * args.n})\n")
        print("| chunks | idle before each | round trip p50 / p90 | `lookup()` returns p50 | chunk hashes p50 "
              "| the connector's `get_num_new_matched_tokens` p50 / p90 | the same, `kvd.presence` off |")
        print("|---|---|---|---|---|---|---|")
        for chunks in (int(c) for c in args.chunks.split(",")):
            tokens = list(range(chunks * 256))
            took = []
            for _ in range(51):
                t = time.perf_counter()
                hashes = native.chunk_hashes(tokens, 256, [], 0)
                took.append(time.perf_counter() - t)
            hash_us = us(took, 0.5)
            measure(client, hashes, 0, 50)  # warm-up
            for gap_ms in (float(g) for g in args.gaps_ms.split(",")):
                total, send = measure(client, hashes, gap_ms / 1e3, args.n if gap_ms else 5 * args.n)
                # With kvd's presence filter (the default: a never-stored prompt is answered
                # without waiting for kvd) and without it (every lookup waits for the reply), in
                # turn, so that both see the machine in the same state.
                conn, waits = measure_connector(url, chunks, gap_ms / 1e3, args.n)
                off, off_waits = measure_connector(url, chunks, gap_ms / 1e3, args.n, presence=False)
                idle = "none (back to back)" if not gap_ms else f"{gap_ms:g} ms"
                print(f"| {chunks} | {idle} | {us(total, 0.5):.0f} / {us(total, 0.9):.0f} µs "
                      f"| {us(send, 0.5):.0f} µs | {hash_us:.0f} µs | {us(conn, 0.5):.0f} / {us(conn, 0.9):.0f} µs"
                      f"{f' ({waits} asked again)' if waits else ''} | {us(off, 0.5):.0f} / {us(off, 0.9):.0f} µs"
                      f"{f' ({off_waits} asked again)' if off_waits else ''} |",
                      flush=True)
    finally:
        srv.terminate()
        srv.wait(10)


if __name__ == "__main__":
    main()
