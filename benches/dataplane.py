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
import signal
import sys
import threading
import time

import torch

from kvd import _native
from kvd.layout import describe

from gpubench import CHUNK, GEOMETRIES, GIB, gpu_mem_by_gpu, gpu_mem_of, kvd_metrics, start_kvd


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
    return {"d2h": d2h, "h2d": h2d, "both": bidir}


def large_allocation_d2h() -> str:
    """D2H GB/s of 1 GiB slices at several offsets of one 16 GiB allocation (a diagnostic: is a
    large allocation itself slower to read than the 4 GiB ceiling buffer?)."""
    big = torch.empty(16 * GIB, dtype=torch.uint8, device="cuda")
    host = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
    out = []
    for off in (0, 5, 10, 15):
        src = big[off * GIB:(off + 1) * GIB]
        host.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(3):
            host.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out.append(f"{3 * GIB / (time.perf_counter() - t) / 1e9:.1f}")
    return ", ".join(out)


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

    def __init__(self, client: _native.Client, order: str, geo: tuple, request_tokens: int, inflight: int, fp: int, spin: bool = True) -> None:
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
        # spin: poll kvd's event holding the GIL (lowest latency); else block in the driver
        # without the GIL, as a connector sharing its process with a model would.
        self.spin = spin
        self.reply_s = self.done_s = 0.0  # summed per-request phases of the last run()
        self.requests = 0
        self.moved = 0  # bytes copied by the last run()
        self.keys = [(1 << 64) * (s + 1) for s in range(inflight)]

    def _chunks(self, slot: int, base: int) -> list:
        """Request slot `slot`'s chunks: hashes from `base`, consecutive blocks (as vLLM hands out
        a fresh request's blocks)."""
        out = []
        for c in range(self.chunks):
            first = (slot * self.chunks + c) * self.per
            out.append((base + c, list(range(first, first + self.per))))
        return out

    def prime(self) -> None:
        """Stores what the retrieves read (kvd skips chunks it already holds)."""
        for s in range(self.inflight):
            outcomes, slot = self.client.store(self.reg.region, 0, self._chunks(s, self.keys[s])).result(30)
            if slot is not None:
                self.reg.synchronize(slot)
        time.sleep(0.05)  # kvd marks the chunks stored once its completion thread saw the copy

    def run(self, op: str, seconds: float, prime: bool = True) -> float:
        """GB/s of `op` ("store" or "retrieve") with `inflight` requests in flight."""
        stream = int(torch.cuda.current_stream().cuda_stream)
        keys = self.keys
        if op == "retrieve" and prime:
            self.prime()
        moved, t0 = 0, time.perf_counter()
        pending: list = []
        self.reply_s = self.done_s = 0.0
        self.requests = 0
        while True:
            now = time.perf_counter()
            while len(pending) < self.inflight and now - t0 < seconds:
                s = len(pending)
                if op == "store":
                    self.serial += 1
                    base = (self.fp << 80) | (self.serial << 32)
                    self.reg.record(self.slot % 64, stream)
                    p = self.client.store(self.reg.region, 0, self._chunks(s, base), wait_slot=self.slot % 64)
                else:
                    p = self.client.retrieve(self.reg.region, 0, self._chunks(s + self.inflight, keys[s]))
                self.slot += 1
                pending.append((time.perf_counter(), p))
            if not pending:
                break
            sent, p = pending.pop(0)
            outcomes, slot = p.result(30)
            replied = time.perf_counter()
            if slot is not None:
                if self.spin:
                    while not self.reg.query(slot):
                        pass
                else:
                    self.reg.synchronize(slot)
            done = time.perf_counter()
            self.reply_s += replied - sent
            self.done_s += done - replied
            self.requests += 1
            # Only chunks actually copied count: stored (0) or loaded (0 for retrieves).
            copied = sum(1 for o in outcomes if o == 0)
            if op == "retrieve" and copied != len(outcomes):
                raise RuntimeError(f"retrieve found {len(outcomes) - copied} of {len(outcomes)} chunks missing")
            moved += copied * self.reg.page_bytes
        self.moved = moved
        return moved / (time.perf_counter() - t0) / 1e9


def matmul_tflops(seconds: float) -> tuple[float, float]:
    """bf16 8192³ matmuls in batches of 10: TFLOP/s by wall clock (counts host-side gaps, such
    as waiting for the GIL between batches) and by GPU time (CUDA events around each batch:
    what the copies cost the GPU itself)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            a @ b
        s.synchronize()
        n, gpu_ms, t0 = 0, 0.0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(s)
            for _ in range(10):
                a @ b
            e1.record(s)
            n += 10
            s.synchronize()
            gpu_ms += e0.elapsed_time(e1)
        dt = time.perf_counter() - t0
    flops = n * 2 * 8192**3
    return flops / dt / 1e12, flops / (gpu_ms / 1e3) / 1e12


class GpuMemory:
    """kvd's GPU memory, two ways: what nvidia-smi attributes to its pid, and device-wide free
    memory against a baseline taken before kvd started, less what this process's PyTorch
    allocator reserved since (so it also counts anything this process took outside PyTorch)."""

    def __init__(self) -> None:
        torch.cuda.synchronize()
        self.free0, _ = torch.cuda.mem_get_info()
        self.reserved0 = torch.cuda.memory_reserved()

    def outside_torch(self) -> int:
        free, _ = torch.cuda.mem_get_info()
        return (self.free0 - free) - (torch.cuda.memory_reserved() - self.reserved0)


class Sampler(threading.Thread):
    """Peak GPU memory of kvd while the benchmark runs (both accountings)."""

    def __init__(self, pid: int, mem: GpuMemory) -> None:
        super().__init__(daemon=True)
        self.pid, self.mem, self.stop = pid, mem, threading.Event()
        self.peak_smi, self.peak_dev = 0, 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(1.0)

    def sample(self) -> None:
        self.peak_smi = max(self.peak_smi, gpu_mem_of(self.pid))
        self.peak_dev = max(self.peak_dev, self.mem.outside_torch())


def histogram_means(http: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of kvd's request and copy-duration histograms."""
    hists = {"request": "kvd_request_duration_seconds", "submit": "kvd_copy_submit_duration_seconds", "copy": "kvd_copy_duration_seconds"}
    m = kvd_metrics(http, tuple(f"{h}_{x}" for h in hists.values() for x in ("sum", "count")))
    return {k: (m[f"{h}_sum"], m[f"{h}_count"]) for k, h in hists.items()}


def per_request(before: dict, after: dict, key: str) -> float:
    ds, dn = after[key][0] - before[key][0], after[key][1] - before[key][1]
    return ds / dn if dn else float("nan")


def table(client, http, ceil, args, breakdown: list) -> None:
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
                for inflight in args.inflight:
                    fp += 1
                    cache = None
                    try:
                        cache = Cache(client, order, geo, tokens, inflight, fp)
                        row = f"| {name} | {order} | {tokens} | {inflight} |"
                        cells = []
                        for op, ceiling in (("store", ceil["d2h"]), ("retrieve", ceil["h2d"])):
                            h0 = histogram_means(http)
                            gbs = cache.run(op, args.seconds)
                            h1 = histogram_means(http)
                            cells.append(f" {gbs:.1f} | {gbs / ceiling:.2f} |")
                            if inflight == 1:
                                ideal_us = cache.bytes_per_request / ceiling / 1e3
                                breakdown.append(
                                    f"{row} {op} | {ideal_us:.0f} | {cache.reply_s / cache.requests * 1e6:.0f} | "
                                    f"{per_request(h0, h1, 'request') * 1e6:.0f} | {per_request(h0, h1, 'submit') * 1e6:.0f} | {per_request(h0, h1, 'copy') * 1e6:.0f} | "
                                    f"{cache.done_s / cache.requests * 1e6:.0f} | {gbs / ceiling:.2f} |")
                        print(row + "".join(cells), flush=True)
                    except Exception as e:  # report and go on: one failure must not hide the rest
                        print(f"| {name} | {order} | {tokens} | {inflight} | error: {e} | | | |", flush=True)
                    if cache is not None:
                        client.unregister(cache.reg.region)
                        del cache
                    torch.cuda.empty_cache()


def set_allocator(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    (setter or torch.cuda.memory._set_allocator_settings)(settings)


def vmm_vs_ipc(client, ceil, args) -> None:
    """The same caches allocated by PyTorch's expandable segments (VMM, shared with kvd by file
    descriptor) and by plain cudaMalloc (legacy IPC), alternated in one process."""
    print("\n| geometry | layout | tokens/request | in flight | path | store GB/s | store/ceiling | retrieve GB/s | retrieve/ceiling | KV cache GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    summary = []
    fp = 5000
    for name in ("llama-3.1-8b", "llama-3.1-70b-tp8", "deepseek-mla-b16"):
        for order in ("BLNHC", "LBNHC"):
            for inflight in (1, 8):
                best: dict[str, list[float]] = {}
                for _rep in range(2):
                    for path in ("ipc", "vmm"):
                        fp += 1
                        cache = None
                        try:
                            set_allocator(f"expandable_segments:{path == 'vmm'}")
                            cache = Cache(client, order, GEOMETRIES[name], 8192, inflight, fp)
                            if cache.reg.shared_by != path:
                                raise RuntimeError(f"registered by {cache.reg.shared_by}, expected {path}")
                            st = cache.run("store", args.seconds)
                            rt = cache.run("retrieve", args.seconds)
                            b = best.setdefault(path, [0.0, 0.0])
                            b[0], b[1] = max(b[0], st), max(b[1], rt)
                            print(f"| {name} | {order} | 8192 | {inflight} | {path} | {st:.1f} | {st / ceil['d2h']:.2f} | {rt:.1f} | {rt / ceil['h2d']:.2f} | {cache.buf.numel() / GIB:.1f} |", flush=True)
                        except Exception as e:
                            print(f"| {name} | {order} | 8192 | {inflight} | {path} | error: {e} | | | | |", flush=True)
                        if cache is not None:
                            client.unregister(cache.reg.region)
                            del cache
                        torch.cuda.empty_cache()
                if "ipc" in best and "vmm" in best:
                    summary.append(f"| {name} | {order} | {inflight} | {best['vmm'][0] / best['ipc'][0]:.3f} | {best['vmm'][1] / best['ipc'][1]:.3f} |")
    set_allocator("expandable_segments:False")
    print("\nVMM path / legacy IPC path, best of two runs each:\n")
    print("| geometry | layout | in flight | store vmm/ipc | retrieve vmm/ipc |")
    print("|---|---|---|---|---|")
    print("\n".join(summary))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvd", required=True)
    ap.add_argument("--pool-gib", type=float, default=48)
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default="", help="comma list of geometries for the main table (default: all)")
    ap.add_argument("--layouts", default="BLNHC,LBNHC")
    ap.add_argument("--sections", default="both,interference,lookup,table,vmm",
                    help="comma list of: both,interference,lookup,table,vmm")
    ap.add_argument("--kvd-log", default=None, help="write kvd's log here")
    ap.add_argument("--inflight", default="1,8", type=lambda v: [int(x) for x in v.split(",")],
                    help="requests in flight for the main table (comma list)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    torch.cuda.init()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    ceil = ceilings()
    torch.cuda.empty_cache()
    print(f"# ceilings (contiguous 4 GiB pinned copies): d2h {ceil['d2h']:.1f} GB/s, h2d {ceil['h2d']:.1f} GB/s, both {ceil['both']:.1f} GB/s")
    print(f"# diagnostic: D2H of 1 GiB slices at offsets 0, 5, 10, 15 GiB of one 16 GiB allocation: {large_allocation_d2h()} GB/s")
    torch.cuda.empty_cache()
    torch.empty(1, device="cuda")
    mem = GpuMemory()
    me_start = gpu_mem_of(os.getpid())
    proc, url, http = start_kvd(args.kvd, args.pool_gib, args.kvd_log)
    try:
        client = _native.Client(url, "bench", role="tool", request_timeout=60)
        kvd_start_smi, kvd_start_dev = gpu_mem_of(proc.pid), mem.outside_torch()
        print(f"# kvd GPU memory at start, by GPU (nvidia-smi): {gpu_mem_by_gpu(proc.pid)}")
        sampler = Sampler(proc.pid, mem)
        sampler.start()
        a = b = None
        if sections & {"both", "interference", "lookup"}:
            a = Cache(client, "BLNHC", GEOMETRIES["llama-3.1-8b"], 8192, 8, 1001, spin=False)
            b = Cache(client, "BLNHC", GEOMETRIES["llama-3.1-8b"], 8192, 8, 1002, spin=False)
        if "both" in sections:
            # Both directions at once, Llama-8B BLNHC, 8192 tokens, 8 in flight each.
            res: dict[str, float] = {}

            def one(op: str, cache: Cache) -> None:
                try:
                    res[op] = cache.run(op, 3 * args.seconds, prime=False)
                except Exception as e:
                    print(f"| both directions: {op} failed: {e} |", flush=True)
                    res[op] = float("nan")

            # Prime b first: primed under a's store load, its first chunks would be evicted
            # before its retrieves begin.
            b.prime()
            t1 = threading.Thread(target=one, args=("store", a))
            t2 = threading.Thread(target=one, args=("retrieve", b))
            t1.start(); t2.start(); t1.join(); t2.join()
            both = res["store"] + res["retrieve"]
            print(f"\n| both directions (llama-3.1-8b BLNHC, 8192 tokens, 8 in flight each) | {res['store']:.1f} store + {res['retrieve']:.1f} retrieve = {both:.1f} GB/s | ceiling {ceil['both']:.1f} | ratio {both / ceil['both']:.2f} |")
        if "interference" in sections:
            # A bf16 matmul loop in this process, alone and while kvd stores, retrieves, or both
            # at once, at full rate (threads that wait for kvd's events without the GIL, as a
            # connector would), alternated three times each.
            stop = threading.Event()
            moved = {"store": 0, "retrieve": 0}

            def churn(op: str, cache: Cache) -> None:
                while not stop.is_set():
                    cache.run(op, 0.25, prime=False)
                    moved[op] += cache.moved

            for mode in ("store", "retrieve", "both"):
                # Stores alone evict what b primed: prime again before each mode.
                b.prime()
                alone, busy, rates = [], [], []
                for _ in range(3):
                    alone.append(matmul_tflops(2 * args.seconds))
                    stop.clear()
                    moved.update(store=0, retrieve=0)
                    ths = [threading.Thread(target=churn, args=(op, c)) for op, c in (("store", a), ("retrieve", b)) if mode in (op, "both")]
                    t = time.perf_counter()
                    for th in ths:
                        th.start()
                    time.sleep(0.3)
                    busy.append(matmul_tflops(2 * args.seconds))
                    stop.set()
                    for th in ths:
                        th.join()
                    rates.append((moved["store"] + moved["retrieve"]) / (time.perf_counter() - t) / 1e9)
                for name, k in (("wall clock", 0), ("GPU time", 1)):
                    al, bu = sorted(x[k] for x in alone)[1], sorted(x[k] for x in busy)[1]
                    print(f"| matmul (bf16 8192³), {name}, kvd copying: {mode} | alone {al:.0f} TFLOP/s (runs {', '.join(f'{x[k]:.0f}' for x in alone)}) | with kvd {bu:.0f} TFLOP/s (runs {', '.join(f'{x[k]:.0f}' for x in busy)}) | slowdown {100 * (1 - bu / al):.2f}% (medians) | kvd moved {', '.join(f'{x:.1f}' for x in rates)} GB/s meanwhile |", flush=True)
        if "lookup" in sections:
            # Lookup latency through the Python client: 32 chunks, all hits.
            keys = [(7 << 96) + c for c in range(32)]
            outcomes, slot = client.store(a.reg.region, 0, [(k, list(range(i * a.per, (i + 1) * a.per))) for i, k in enumerate(keys)]).result(30)
            if slot is not None:
                a.reg.synchronize(slot)
            time.sleep(0.05)
            hit, _ = client.lookup(1001, 0, [0], keys, pin=False).result(10)
            lat = []
            for _ in range(3000):
                t = time.perf_counter()
                client.lookup(1001, 0, [0], keys, pin=False).result(10)
                lat.append(time.perf_counter() - t)
            lat.sort()
            print(f"| lookup of 32 chunks ({hit} hit), Python client, one at a time | p50 {lat[len(lat) // 2] * 1e6:.0f} µs | p99 {lat[int(len(lat) * 0.99)] * 1e6:.0f} µs | max {lat[-1] * 1e6:.0f} µs |")
        for c in (a, b):
            if c is not None:
                client.unregister(c.reg.region)
        a = b = None
        torch.cuda.empty_cache()
        breakdown: list[str] = []
        if "table" in sections:
            table(client, http, ceil, args, breakdown)
        if breakdown:
            print("\nOne request in flight, where a request's time goes (µs per request; copy at the ceiling = "
                  "bytes / ceiling; kvd handling = arrival to reply queued; kvd submit = the copy thread's driver calls; kvd copy = submission to completion "
                  "seen by kvd's completion thread; client = send to reply, and reply to kvd's event seen):\n")
            print("| geometry | layout | tokens/request | in flight | op | copy at the ceiling | client send→reply | kvd handling | kvd submit | kvd copy | client reply→done | ratio |")
            print("|---|---|---|---|---|---|---|---|---|---|---|---|")
            print("\n".join(breakdown))
        if "vmm" in sections:
            vmm_vs_ipc(client, ceil, args)
        sampler.stop.set()
        sampler.join()
        sampler.sample()
        print(f"\n| kvd GPU memory | at start: {kvd_start_smi} MiB (nvidia-smi), {kvd_start_dev / 2**20:.0f} MiB (device-wide) | peak under load: {sampler.peak_smi} MiB (nvidia-smi), {sampler.peak_dev / 2**20:.0f} MiB (device-wide) | at the end: {gpu_mem_of(proc.pid)} MiB, {mem.outside_torch() / 2**20:.0f} MiB |")
        print(f"# kvd GPU memory at the end, by GPU (nvidia-smi): {gpu_mem_by_gpu(proc.pid)}")
        me_end = gpu_mem_of(os.getpid())
        print(f"| client process GPU memory (nvidia-smi) | at start {me_start} MiB | at the end {me_end} MiB | PyTorch reserved now {torch.cuda.memory_reserved() / 2**20:.0f} MiB, {(torch.cuda.memory_reserved() - mem.reserved0) / 2**20:.0f} MiB more than at start |")
        m = kvd_metrics(http, ("kvd_copy_batch_fallbacks_total", "kvd_copy_errors_total", "kvd_copy_queue_full_total"))
        print("| kvd counters | " + " | ".join(f"{k} {v:.0f}" for k, v in m.items()) + " |")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


if __name__ == "__main__":
    sys.exit(main())
