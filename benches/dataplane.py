#!/usr/bin/env python3
"""kvd's GPU data-plane benchmark (figures go to benches/RESULTS.md).

Runs on a GPU host with torch and the kvd wheel installed, against a kvd it starts itself:

    python3 benches/dataplane.py --kvd target/release/kvd [--quick]

Every throughput is reported next to ceilings measured in the same run: a contiguous 4 GiB
pinned copy in each direction, and both directions at once. The KV caches are allocated as
vLLM 0.33 does (one int8 buffer, per-layer [blocks, heads, tokens, content] views), registered
through the kvd client exactly as the connector registers them, and moved in 256-token chunks
with 1 and 8 requests in flight; each request waits for kvd's interprocess event.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

import torch

from kvd import _native
from kvd.layout import describe

CHUNK = 256
GIB = 1 << 30

GEOMETRIES = {
    # name: (layers, kv heads per shard, content (K‖V or MLA latent), block tokens)
    "llama-3.1-8b": (32, 8, 256, 16),
    "llama-3.1-70b-tp8": (80, 1, 256, 16),
    "deepseek-mla-b16": (61, 1, 576, 16),
    "deepseek-mla-b64": (61, 1, 576, 64),
}


def start_kvd(binary: str, pool_gib: float) -> tuple[subprocess.Popen, str, str]:
    fd = f"/tmp/kvd-bench-{os.getpid()}.fd.sock"
    p = subprocess.Popen(
        [binary, "serve", "--l1-size-gb", str(pool_gib), "--port", "0", "--http-port", "0", "--fd-socket", fd, "--chunk-tokens", str(CHUNK)],
        stderr=subprocess.PIPE, text=True,
    )
    url = http = None
    for line in p.stderr:
        m = re.search(r"listening for clients on (tcp://\S+)", line)
        if m:
            url = m.group(1)
        m = re.search(r"serving /healthz and /metrics on http://(\S+)", line)
        if m:
            http = m.group(1)
        if "populated" in line or "pinned" in line:
            print("#", line.strip().split("  ")[-1])
        if "ready in" in line:
            break
    threading.Thread(target=lambda: [None for _ in p.stderr], daemon=True).start()
    assert url and http, "kvd did not start"
    return p, url, http


def gpu_mem_of(pid: int) -> int:
    """MiB of GPU memory nvidia-smi attributes to `pid` (all GPUs)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout
    except Exception:
        return -1
    return sum(int(m) for p_, m in (l.split(",") for l in out.strip().splitlines() if l) if int(p_) == pid)


class Sampler(threading.Thread):
    """Peak GPU memory of a process while a benchmark runs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, gpu_mem_of(self.pid))
            self.stop.wait(0.5)


def kvd_metrics(http: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of kvd's Prometheus samples by name."""
    import urllib.request

    body = urllib.request.urlopen(f"http://{http}/metrics", timeout=5).read().decode()
    out = {n: 0.0 for n in names}
    for line in body.splitlines():
        for n in names:
            if line.startswith(n) and line[len(n)] in " {":
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


def ceilings() -> dict[str, float]:
    """Contiguous pinned copies of 4 GiB: D2H, H2D, and both at once on two streams."""
    n = 4 * GIB
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev2 = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return best

    d2h = n / timed(lambda: host.copy_(dev, non_blocking=True)) / 1e9
    h2d = n / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9

    def both():
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    bidir = 2 * n / timed(both) / 1e9
    del dev, dev2, host, host2
    torch.cuda.empty_cache()
    return {"d2h": d2h, "h2d": h2d, "both": bidir}


def allocate(order: str, layers: int, blocks: int, heads: int, tokens: int, content: int):
    size = {"L": layers, "B": blocks, "H": heads, "N": tokens, "C": content}
    stride, acc = {}, 1
    for c in reversed(order):
        stride[c] = acc
        acc *= size[c]
    buf = torch.empty(acc * 2, dtype=torch.int8, device="cuda")
    typed = buf.view(torch.bfloat16)
    views = [torch.as_strided(typed, (blocks, heads, tokens, content), (stride["B"], stride["H"], stride["N"], stride["C"]), l * stride["L"]) for l in range(layers)]
    return buf, views


class Cache:
    """One registered KV cache and helpers to move whole requests."""

    def __init__(self, client: _native.Client, order: str, geo: tuple, request_tokens: int, inflight: int, fp: int) -> None:
        layers, heads, content, block = geo
        self.per = CHUNK // block
        self.chunks = request_tokens // CHUNK
        self.blocks = 2 * inflight * self.chunks * self.per
        self.buf, views = allocate(order, layers, self.blocks, heads, block, content)
        self.buf.random_(-128, 127)
        spec = describe(views)
        self.reg = client.register(fp, 0, "cuda", spec.layer_ptrs, spec.layout, events=64)
        self.client, self.fp, self.inflight = client, fp, inflight
        self.bytes_per_request = self.chunks * self.reg.page_bytes
        self.slot = 0
        self.serial = 0

    def _chunks(self, slot: int, base: int, scattered: bool) -> list:
        out = []
        for c in range(self.chunks):
            first = (slot * self.chunks + c) * self.per
            if scattered:  # every other block: descriptors cannot coalesce across blocks
                blocks = [(first * 2 + 2 * i) % self.blocks for i in range(self.per)]
            else:
                blocks = list(range(first, first + self.per))
            out.append((base + c, blocks))
        return out

    def run(self, op: str, seconds: float, scattered: bool = False) -> float:
        """GB/s of `op` ("store" or "retrieve") with `inflight` requests in flight."""
        stream = int(torch.cuda.current_stream().cuda_stream)
        keys = [(1 << 64) * (s + 1) for s in range(self.inflight)]
        if op == "retrieve":
            for s in range(self.inflight):  # make sure there is something to retrieve
                outcomes, slot = self.client.store(self.reg.region, 0, self._chunks(s, keys[s], scattered)).result(30)
                if slot is not None:
                    self.reg.synchronize(slot)
            time.sleep(0.05)  # kvd marks the chunks stored once its completion thread saw the copy
        moved, t0 = 0, time.perf_counter()
        pending: list = []
        while True:
            now = time.perf_counter()
            while len(pending) < self.inflight and now - t0 < seconds:
                s = len(pending)
                if op == "store":
                    self.serial += 1
                    base = (self.fp << 80) | (self.serial << 32)
                    self.reg.record(self.slot % 64, stream)
                    p = self.client.store(self.reg.region, 0, self._chunks(s, base, scattered), wait_slot=self.slot % 64)
                else:
                    p = self.client.retrieve(self.reg.region, 0, self._chunks(s + self.inflight, keys[s], scattered))
                self.slot += 1
                pending.append(p)
            if not pending:
                break
            p = pending.pop(0)
            outcomes, slot = p.result(30)
            if slot is not None:
                while not self.reg.query(slot):
                    pass
            # Only chunks actually copied count: stored (0) or loaded (0 for retrieves).
            copied = sum(1 for o in outcomes if o == 0)
            if op == "retrieve" and copied != len(outcomes):
                raise RuntimeError(f"retrieve found {len(outcomes) - copied} of {len(outcomes)} chunks missing")
            moved += copied * self.reg.page_bytes
        return moved / (time.perf_counter() - t0) / 1e9


def matmul_tflops(seconds: float, stop: threading.Event | None = None) -> float:
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            a @ b
        s.synchronize()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(10):
                a @ b
            n += 10
            s.synchronize()
        dt = time.perf_counter() - t0
    return n * 2 * 8192**3 / dt / 1e12


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd", required=True)
    ap.add_argument("--pool-gib", type=float, default=48)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma list of geometries to run (default: all)")
    ap.add_argument("--layouts", default="BLNHC,LBNHC")
    args = ap.parse_args()
    torch.cuda.init()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    ceil = ceilings()
    print(f"# ceilings (contiguous 4 GiB pinned copies): d2h {ceil['d2h']:.1f} GB/s, h2d {ceil['h2d']:.1f} GB/s, both {ceil['both']:.1f} GB/s")
    proc, url, http = start_kvd(args.kvd, args.pool_gib)
    try:
        client = _native.Client(url, "bench", role="tool", request_timeout=60)
        kvd_start = gpu_mem_of(proc.pid)
        sampler = Sampler(proc.pid)
        sampler.start()
        free0, _ = torch.cuda.mem_get_info()
        print("\n| geometry | layout | tokens/request | in flight | store GB/s | store/ceiling | retrieve GB/s | retrieve/ceiling |")
        print("|---|---|---|---|---|---|---|---|")
        fp = 1
        sizes = [2048] if args.quick else [2048, 8192]
        only = set(filter(None, args.only.split(",")))
        for name, geo in GEOMETRIES.items():
            if only and name not in only:
                continue
            for order in args.layouts.split(","):
                for tokens in sizes:
                    if geo[3] == 64 and tokens == 8192 and args.quick:
                        continue
                    for inflight in (1, 8):
                        fp += 1
                        cache = None
                        try:
                            cache = Cache(client, order, geo, tokens, inflight, fp)
                            st = cache.run("store", args.seconds)
                            rt = cache.run("retrieve", args.seconds)
                            print(f"| {name} | {order} | {tokens} | {inflight} | {st:.1f} | {st / ceil['d2h']:.2f} | {rt:.1f} | {rt / ceil['h2d']:.2f} |", flush=True)
                        except Exception as e:  # report and go on: one failure must not hide the rest
                            print(f"| {name} | {order} | {tokens} | {inflight} | error: {e} | | | |", flush=True)
                        if cache is not None:
                            client.unregister(cache.reg.region)
                            del cache
                        torch.cuda.empty_cache()
        # Both directions at once, Llama-8B BLNHC, 8192 tokens, 8 in flight each.
        a = Cache(client, "BLNHC", GEOMETRIES["llama-3.1-8b"], 8192, 8, 1001)
        b = Cache(client, "BLNHC", GEOMETRIES["llama-3.1-8b"], 8192, 8, 1002)
        res: dict[str, float] = {}
        t1 = threading.Thread(target=lambda: res.__setitem__("store", a.run("store", 3 * args.seconds)))
        t2 = threading.Thread(target=lambda: res.__setitem__("retrieve", b.run("retrieve", 3 * args.seconds)))
        t1.start(); t2.start(); t1.join(); t2.join()
        both = res["store"] + res["retrieve"]
        print(f"\n| both directions (llama-3.1-8b BLNHC, 8192 tokens, 8 in flight each) | {res['store']:.1f} store + {res['retrieve']:.1f} retrieve = {both:.1f} GB/s | ceiling {ceil['both']:.1f} | ratio {both / ceil['both']:.2f} |")
        # Interference: a bf16 matmul loop in this process while kvd stores and retrieves at full rate.
        alone = matmul_tflops(4 * args.seconds)
        stop = threading.Event()

        def churn():
            while not stop.is_set():
                a.run("store", 0.5)
                b.run("retrieve", 0.5)

        th = threading.Thread(target=churn)
        th.start()
        time.sleep(0.5)
        busy = matmul_tflops(4 * args.seconds)
        stop.set()
        th.join()
        print(f"| matmul (bf16 8192³) alone | {alone:.0f} TFLOP/s | with kvd copying | {busy:.0f} TFLOP/s | slowdown {100 * (1 - busy / alone):.2f}% |")
        # Lookup latency through the Python client (32 chunks, hit).
        keys = [(1 << 64) * (s + 1) + c for s in range(1) for c in range(32)]
        client.store(a.reg.region, 0, [(k, list(range(i * a.per, (i + 1) * a.per))) for i, k in enumerate(keys)]).result(30)
        lat = []
        for _ in range(2000):
            t = time.perf_counter()
            client.lookup(1001, 0, [0], keys, pin=False).result(10)
            lat.append(time.perf_counter() - t)
        lat.sort()
        print(f"| lookup of 32 chunks, Python client | p50 {lat[len(lat) // 2] * 1e6:.0f} µs | p99 {lat[int(len(lat) * 0.99)] * 1e6:.0f} µs |")
        sampler.stop.set()
        sampler.join()
        free1, _ = torch.cuda.mem_get_info()
        print(f"| kvd GPU memory (nvidia-smi) | start {kvd_start} MiB | peak {sampler.peak} MiB |")
        m = kvd_metrics(http, ("kvd_copy_batch_fallbacks_total", "kvd_copy_errors_total", "kvd_copy_queue_full_total"))
        print(f"| kvd counters | " + " | ".join(f"{k} {v:.0f}" for k, v in m.items()) + " |")
        print(f"| client GPU memory beyond its KV caches | {(free0 - free1) / 2**20 - (torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / 2**20:.0f} MiB device-wide change, torch reserved {torch.cuda.memory_reserved() / 2**20:.0f} MiB |")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
