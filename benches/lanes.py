#!/usr/bin/env python3
"""A retrieve's wait while stores stream: two kvd builds in one run, on the host backend or a GPU.

vLLM's forward pass waits for kvd's answer to a synchronous load, so a retrieve that queues
behind store submissions holds every running request's next token. This bench measures that
wait without a GPU: a worker (kvd's host backend, a ``kvd.HostBuffer`` standing in for GPU
memory, laid out as vLLM 0.26 lays out its per-layer caches, so a chunk is many small runs)
keeps large stores in flight while a second worker retrieves one held chunk every few
milliseconds and times kvd's answer. Each kvd build (``--kvd`` and ``--kvd-base``) runs a phase
without stores (the retrieve alone) and one with them, in alternating order over ``--rounds``.

On the host backend a copy is a ``memcpy`` done by the copy thread itself, so the store a
retrieve queues behind costs its whole copy, where a GPU's costs its submission (about a
microsecond of CPU a descriptor): the mechanism is the same, the scale is this machine's.
``--gpu`` puts both workers' caches in GPU memory (torch), so kvd's CUDA backend copies and the
wait is the GPU's case; it also times the retrieve's copy to its end (kvd's done event).
The Llama-3.1-70B shape as vLLM 0.26's FlashAttention lays it out per layer (K and V packed in a
layer-block, bf16): ``--gpu --layers 80 --heads 8 --content 256`` (a 256-token chunk is 1,280
runs of 64 KiB, 80 MiB); session 39 ran ``--layers 160 --content 128 --elem 1`` (2,560 of 16 KiB).

    python3 benches/lanes.py --kvd target/release/kvd --kvd-base OLD/kvd [--rounds 3] [--gpu]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import statistics
import sys
import tempfile
import threading
import time

from kvd import _native
from kvd.layout import describe, device_of
from kvd.testing import order_strides, until, vllm_cache

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import vllm_harness as vh  # noqa: E402
from node_router import pct  # noqa: E402

#: vLLM 0.26's per-layer layout: each layer's blocks apart, so a chunk of 16 blocks whose ids
#: are not consecutive is 16 runs a layer.
LAYOUT = "LBNHC"
BLOCK_TOKENS = 16
#: Numbers each phase's kvd log.
PHASES = itertools.count(1)


def gpu_cache(layers: int, blocks: int, heads: int, content: int, elem: int):
    """The GPU twin of ``vllm_cache``: one torch buffer, a view a layer (``[B, H, N, C]``)."""
    import torch

    acc, stride = order_strides(LAYOUT, layers, blocks, heads, BLOCK_TOKENS, content)
    typed = torch.zeros(acc * elem, dtype=torch.int8, device="cuda").view({1: torch.uint8, 2: torch.bfloat16}[elem])
    views = [torch.as_strided(typed, (blocks, heads, BLOCK_TOKENS, content),
                              (stride["B"], stride["H"], stride["N"], stride["C"]), layer * stride["L"])
             for layer in range(layers)]
    return typed, views


class Worker:
    """A kvd client with its own KV cache (host, or GPU with ``args.gpu``), registered as vLLM's
    worker registers."""

    def __init__(self, url: str, name: str, args, blocks: int, fingerprint: int) -> None:
        self.client = _native.Client(url, name, role="worker", connect_timeout=5.0, request_timeout=30.0)
        self.chunk_blocks = self.client.server["chunk_tokens"] // BLOCK_TOKENS
        if args.gpu:
            self.buf, views = gpu_cache(args.layers, blocks, args.heads, args.content, args.elem)
            device = device_of(views[0])
        else:
            self.buf, views = vllm_cache(LAYOUT, args.layers, blocks, args.heads, BLOCK_TOKENS, args.content, args.elem)
            self.buf.fill_random(fingerprint & 0xFFFF_FFFF)
            device = "host"
        spec = describe(views)
        self.chunk_bytes = spec.block_bytes * args.layers * self.chunk_blocks
        self.fingerprint = fingerprint
        self.reg = self.client.register(fingerprint, 0, device, spec.layer_ptrs, spec.layout)
        self.region = self.reg.region
        # Blocks in a shuffled order, as a busy engine's free list hands them out.
        self.blocks = list(range(blocks))
        random.Random(fingerprint).shuffle(self.blocks)

    def chunk(self, i: int) -> list[int]:
        n = self.chunk_blocks
        j = i % (len(self.blocks) // n)
        return self.blocks[j * n:(j + 1) * n]


def storer(w: Worker, chunks: int, inflight: int, stop: threading.Event, out: dict) -> None:
    """Stores of ``chunks`` fresh chunks each, ``inflight`` at a time, until ``stop``."""
    pending: list = []
    n = 0
    stored = 0
    t0 = time.monotonic()
    while not stop.is_set() or pending:
        while not stop.is_set() and len(pending) < inflight:
            req = [(random.getrandbits(63), w.chunk(n * chunks + c)) for c in range(chunks)]
            pending.append(w.client.store(w.region, 0, req))
            n += 1
        codes, slot = pending.pop(0).result(60.0)
        if slot is not None:
            w.reg.synchronize(slot)  # a GPU store counts once its copy is done
        stored += sum(1 for c in codes if c in (_native.STORED, _native.ALREADY_STORED))
    out["stored_gib"] = stored * w.chunk_bytes / 2**30
    out["store_gbps"] = stored * w.chunk_bytes / (time.monotonic() - t0) / 1e9


def prober(w: Worker, keys: list[int], blocks: list[list[int]], every_s: float, seconds: float, out: list[float],
           done: list[float] | None = None) -> None:
    """Every ``every_s``: pins the held chunks, retrieves them in one request (as a request's
    load is one), and records the retrieve's answer time (in ``out``) and, on a GPU, the time to
    its copy's end (in ``done``)."""
    end = time.monotonic() + seconds
    while True:
        hit, pin = w.client.lookup(w.fingerprint, 0, [0], keys, pin=True).result(10.0)
        if hit != len(keys):
            raise RuntimeError(f"the probe's chunks were evicted (hit {hit} of {len(keys)}): give kvd a larger --pool-gib")
        t = time.perf_counter()
        codes, slot = w.client.retrieve(w.region, 0, list(zip(keys, blocks)), pin_id=pin).result(30.0)
        out.append(time.perf_counter() - t)
        if slot is not None:
            w.reg.synchronize(slot)
            if done is not None:
                done.append(time.perf_counter() - t)
        if any(c != _native.LOADED for c in codes):
            raise RuntimeError(f"the probe's retrieve answered {list(codes)}, not LOADED")
        if time.monotonic() >= end:
            return
        time.sleep(every_s)


def phase(name: str, binary: str, args, stores: bool) -> dict:
    """One kvd start: the probe alone or with stores streaming; its retrieve times."""
    log = os.path.join(args.out, f"lanes-{name}-{next(PHASES)}.log")
    server = vh.KvdServer(binary, args.pool_gib, args.chunk_tokens, log)
    server.start()
    try:
        fp = random.getrandbits(62)
        n = args.probe_chunks
        probe = Worker(server.url, "lanes-probe", args, 2 * n * args.chunk_tokens // BLOCK_TOKENS, fp)
        keys = [random.getrandbits(63) for _ in range(n)]
        src, dst = [probe.chunk(i) for i in range(n)], [probe.chunk(n + i) for i in range(n)]
        codes, slot = probe.client.store(probe.region, 0, list(zip(keys, src))).result(10.0)
        assert all(c == _native.STORED for c in codes), codes
        if slot is not None:
            probe.reg.synchronize(slot)
        # A chunk is readable once kvd has seen its copy end, a moment after the GPU did.
        until(lambda: probe.client.lookup(fp, 0, [0], keys, pin=False).result(10.0)[0] == n, 10.0,
              "the probe's stored chunks to become readable")
        # Read once before any store: a chunk nobody has asked for is the first to go. It is the
        # retrieve lane's first job, timed apart (a cost a lane pays once shows here).
        first: list[float] = []
        prober(probe, keys, dst, 0.0, 0.0, first)
        times: list[float] = []
        done: list[float] = []
        res: dict = {"binary": binary, "stores": stores, "first_ms": first[0] * 1e3}
        if stores:
            w = Worker(server.url, "lanes-store", args, 2 * args.store_chunks * args.chunk_tokens // BLOCK_TOKENS, fp + 1)
            stop = threading.Event()
            t = threading.Thread(target=storer, args=(w, args.store_chunks, args.inflight, stop, res))
            t.start()
            time.sleep(0.5)  # stores under way before the first probe
            try:
                prober(probe, keys, dst, args.every_s, args.seconds, times, done)
            finally:
                stop.set()
                t.join()
        else:
            prober(probe, keys, dst, args.every_s, args.seconds, times, done)
        res.update(n=len(times), p50_ms=pct(times, 0.5) * 1e3, p90_ms=pct(times, 0.9) * 1e3,
                   p99_ms=pct(times, 0.99) * 1e3, max_ms=max(times) * 1e3, chunk_mib=probe.chunk_bytes / 2**20)
        if args.gpu and not done:
            raise RuntimeError("kvd's retrieves carried no done event: the GPU registration has no events "
                               "(is kvd running on its CUDA backend? see its log)")
        if done:
            res.update(done_p50_ms=pct(done, 0.5) * 1e3, done_p99_ms=pct(done, 0.99) * 1e3)
        return res
    finally:
        server.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvd", default=vh.default_kvd())
    ap.add_argument("--kvd-base", required=True, help="the other kvd build")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=6.0, help="probing time of a phase")
    ap.add_argument("--every-s", type=float, default=0.005)
    ap.add_argument("--gpu", action="store_true", help="both workers' caches in GPU memory (torch, cuda:0)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--content", type=int, default=128)
    ap.add_argument("--elem", type=int, choices=(1, 2), default=2, help="bytes an element")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--store-chunks", type=int, default=16, help="chunks of one store request")
    ap.add_argument("--probe-chunks", type=int, default=1, help="chunks of one probe retrieve (a 4,096-token load is 16)")
    ap.add_argument("--inflight", type=int, default=4, help="store requests in flight")
    ap.add_argument("--pool-gib", type=float, default=4.0)
    ap.add_argument("--out", default=tempfile.gettempdir())
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    builds = {"kvd": args.kvd, "kvd-base": args.kvd_base}
    rows: list[tuple[str, dict]] = []
    for r in range(args.rounds):
        order = list(builds) if r % 2 == 0 else list(reversed(builds))
        for name in order:
            for stores in (False, True):
                res = phase(name, builds[name], args, stores)
                rows.append((name, res))
                print(f"# round {r + 1} {name} {'stores' if stores else 'alone'}: first retrieve {res['first_ms']:.2f} ms, "
                      f"then {res['n']} retrieves, "
                      f"p50 {res['p50_ms']:.2f} ms, p99 {res['p99_ms']:.2f} ms, max {res['max_ms']:.1f} ms"
                      + (f"; copy done p50 {res['done_p50_ms']:.2f} ms, p99 {res['done_p99_ms']:.2f} ms" if args.gpu else "")
                      + (f"; stored {res['stored_gib']:.1f} GiB at {res['store_gbps']:.2f} GB/s" if stores else ""),
                      flush=True)
    where = "GPU memory (kvd's CUDA backend)" if args.gpu else "host memory (kvd's host backend)"
    print(f"\nOne retrieve of {args.probe_chunks} chunk(s) of {rows[0][1]['chunk_mib']:.0f} MiB ({args.layers} layers x "
          f"{args.chunk_tokens // BLOCK_TOKENS} blocks, {LAYOUT}, in {where}), kvd's answer time; stores of "
          f"{args.store_chunks} chunks, {args.inflight} in flight. Medians over {args.rounds} rounds.\n")
    done_cols = " copy done p50 | copy done p99 |" if args.gpu else ""
    print(f"| build | phase | retrieve p50 (ms) | p90 | p99 | max | the lane's first (each) |{done_cols} stores GB/s |")
    print("|---|---|---|---|---|---|---|" + ("---|---|" if args.gpu else "") + "---|")
    for name in builds:
        for stores in (False, True):
            rs = [res for n, res in rows if n == name and res["stores"] == stores]
            keys = ("p50_ms", "p90_ms", "p99_ms", "max_ms") + (("done_p50_ms", "done_p99_ms") if args.gpu else ())
            med = {k: statistics.median(x[k] for x in rs) for k in keys}
            done_vals = f" {med['done_p50_ms']:.2f} | {med['done_p99_ms']:.2f} |" if args.gpu else ""
            gbps = f"{statistics.median(x['store_gbps'] for x in rs):.2f}" if stores else "–"
            each = ", ".join(f"{x['p99_ms']:.1f}" for x in rs)
            firsts = ", ".join(f"{x['first_ms']:.1f}" for x in rs)
            print(f"| {name} | {'with stores' if stores else 'alone'} | {med['p50_ms']:.2f} | {med['p90_ms']:.2f} | "
                  f"{med['p99_ms']:.2f} (each: {each}) | {med['max_ms']:.1f} | {firsts} |{done_vals} {gbps} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
