#!/usr/bin/env python3
"""How many copy descriptors the CUDA driver queues behind an unfinished event before the
enqueueing call blocks (GPU host; torch and the driver's cuMemcpyBatchAsync_v2 through ctypes).

Why: under vLLM's asynchronous scheduling a step's load is asked for while the previous step's
forward pass still runs. kvd's copies wait on the client's event for it, and a 70B load in vLLM
0.26's per-layer layout is ~15,000 descriptors of 64 KiB; session 40's engine logs showed one
batch call blocking 339 ms (a retrieve) and 1.7 s (a store) while the engine's host waited for
kvd's answer. This measures the queue in isolation: a gate event recorded after a sleep kernel
on another stream, then copies enqueued the way kvd's copy lane does (batch calls cut at 8 MiB),
spread over 1..K streams that each wait on the gate. Per case: the descriptors enqueued before
the first call that blocked (> --block-ms), that call's time, the whole enqueue, and the gate.

    python3 benches/queue_probe.py [--gib 2] [--gate-ms 300] [--streams 1,2,4] [--runs 65536,1048576]
"""
from __future__ import annotations

import argparse
import ctypes
import time


class Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", Loc), ("dstLocHint", Loc), ("flags", ctypes.c_uint)]


ORDER_STREAM, LOC_DEVICE, LOC_HOST, PREFER_OVERLAP = 1, 1, 2, 1
PIPELINE_BYTES = 8 << 20  # kvd's batch cut (gpu/src/runtime/engine.rs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.0, help="bytes of one job")
    ap.add_argument("--gate-ms", type=float, default=300.0, help="how long the gate's sleep kernel runs")
    ap.add_argument("--streams", default="1,2,4")
    ap.add_argument("--runs", default="65536,1048576", help="descriptor sizes in bytes")
    ap.add_argument("--dirs", default="h2d,d2h")
    ap.add_argument("--block-ms", type=float, default=5.0, help="a call slower than this blocked")
    a = ap.parse_args()

    import torch

    torch.cuda.init()
    cuda = ctypes.CDLL("libcuda.so.1")
    batch = cuda.cuMemcpyBatchAsync_v2
    batch.restype = ctypes.c_int
    dev = torch.cuda.current_device()
    total = int(a.gib * (1 << 30))
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(total, dtype=torch.uint8, device="cuda")
    hbase, gbase = host.data_ptr(), gpu.data_ptr()

    # Cycles for the gate: time one sleep kernel.
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(100_000_000)
    torch.cuda.synchronize()
    cycles_per_ms = 100_000_000 / ((time.perf_counter() - t) * 1e3)

    print(f"# {torch.cuda.get_device_name(dev)}; job {total / 2**30:.2f} GiB; gate {a.gate_ms:.0f} ms; "
          f"batch calls cut at {PIPELINE_BYTES >> 20} MiB; a call over {a.block_ms:.0f} ms counts as blocked")
    print("| dir | run | streams | descriptors | gated | enqueued before the first block | that call (ms) | "
          "enqueue (ms) | enqueue to done (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    side = torch.cuda.Stream()
    for direction in a.dirs.split(","):
        for run in (int(r) for r in a.runs.split(",")):
            n = total // run
            per_call = max(1, PIPELINE_BYTES // run)
            for k in (int(s) for s in a.streams.split(",")):
                streams = [torch.cuda.Stream() for _ in range(k)]
                for gated in (True, False):
                    torch.cuda.synchronize()
                    gate = torch.cuda.Event()
                    if gated:
                        with torch.cuda.stream(side):
                            torch.cuda._sleep(int(a.gate_ms * cycles_per_ms))
                        gate.record(side)
                        for s in streams:
                            s.wait_event(gate)
                    first_block, block_ms, calls = None, 0.0, 0
                    t0 = time.perf_counter()
                    for start in range(0, n, per_call):
                        m = min(per_call, n - start)
                        offs = [(start + i) * run for i in range(m)]
                        h = [hbase + o for o in offs]
                        g = [gbase + o for o in offs]
                        dsts, srcs = (g, h) if direction == "h2d" else (h, g)
                        d = (ctypes.c_uint64 * m)(*dsts)
                        s_ = (ctypes.c_uint64 * m)(*srcs)
                        z = (ctypes.c_size_t * m)(*([run] * m))
                        dev_loc, host_loc = Loc(LOC_DEVICE, dev), Loc(LOC_HOST, 0)
                        attr = Attrs(ORDER_STREAM, host_loc if direction == "h2d" else dev_loc,
                                     dev_loc if direction == "h2d" else host_loc, PREFER_OVERLAP)
                        idx = ctypes.c_size_t(0)
                        stream = streams[calls % k]
                        c0 = time.perf_counter()
                        rc = batch(d, s_, z, ctypes.c_size_t(m), ctypes.byref(attr), ctypes.byref(idx),
                                   ctypes.c_size_t(1), ctypes.c_void_p(stream.cuda_stream))
                        took = (time.perf_counter() - c0) * 1e3
                        if rc != 0:
                            raise SystemExit(f"cuMemcpyBatchAsync_v2 returned {rc}")
                        if first_block is None and took > a.block_ms:
                            first_block, block_ms = start, took
                        calls += 1
                    enq = (time.perf_counter() - t0) * 1e3
                    torch.cuda.synchronize()
                    done = (time.perf_counter() - t0) * 1e3
                    fb = "never" if first_block is None else f"{first_block:,}"
                    print(f"| {direction} | {run >> 10} KiB | {k} | {n:,} | {'yes' if gated else 'no'} | {fb} | "
                          f"{block_ms:.1f} | {enq:.1f} | {done:.1f} |", flush=True)


if __name__ == "__main__":
    main()
