#!/usr/bin/env python3
"""One kvd for a whole multi-GPU node, one client process per GPU (issue 14).

On a GPU host with torch and the kvd wheel, against a kvd it starts itself:

    python3 benches/multigpu.py --kvd .device/bin/kvd [--gpus N] [--stages 1,2,3,4]
    python3 benches/multigpu.py --kvd target/debug/kvd --host      # host memory, no torch

Four stages, each with its own timeout and its own markdown table; a stage that fails is
reported and the next one runs (kvd is started again if it died):

1. data plane on all GPUs at once: each GPU's copy ceilings alone and all at once (no kvd),
   then every GPU's process storing and retrieving at once (Llama-8B-like, BLNHC then LBNHC):
   per-GPU and aggregate GB/s against those ceilings, and kvd's CPU cores from /proc;
2. an MLA cache shared by N TP ranks: rank 0 stores, a scheduler-side lookup pins the hit for N
   readers (as the connector does), every rank retrieves into other blocks;
3. TP shards of a Llama-70B-like cache (one KV head per rank): every rank stores and retrieves
   its own shard at once;
4. every rank SIGKILLed at once: kvd must give back every mapping within 10 s, stay healthy,
   and serve fresh clients.

Every byte moved is compared. The whole run keeps to --budget-s (360 s): a stage whose
timeout would eat into the 20 s kept for each later stage is cut short, and one that cannot
start in time is reported skipped. kvd's pool is sized explicitly (24 GiB per GPU + 8); where
MemTotal reads less (VMs whose memory grows as it is used), memory is touched first until it
does, since kvd refuses a pool above MemTotal. Exit status 0 only if every stage passed.

--host runs the same processes and stages on kvd.HostBuffer memory (device "host") with small
requests and at most two layers: it checks the orchestration and the bytes, not speed
(connector-py/tests/test_multigpu_host.py runs it in CI).

Files: multigpu_stages.py (each stage's orchestration and tables), multigpu_ranks.py (the
rank processes), kvmem.py (KV caches and copy ceilings), gpubench.py (shared with dataplane.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpubench import CHUNK, GIB, meminfo_bytes, start_kvd  # noqa: E402
from multigpu_ranks import FP_WARM, HOST_LAYERS, Region, _client, geometry, kill_chunks, mono, pipeline  # noqa: E402
from multigpu_stages import STAGES  # noqa: E402

LATER_STAGE_S = 20  # budget kept for each stage still to run


class Interrupted(BaseException):
    """SIGTERM (an outer `timeout`): end the stage, print the summary, stop kvd."""


def _on_sigterm(signum, frame) -> None:
    raise Interrupted()


# --- the run -----------------------------------------------------------------------------------


class Kvd:
    """The kvd this run started."""

    def __init__(self, args, pool_gib: float, on_first_line=None) -> None:
        self.proc, self.url, self.http = start_kvd(args.kvd, pool_gib, args.kvd_log, timeout_s=args.kvd_start_timeout_s,
                                                   on_first_line=on_first_line)
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> tuple[int | None, float]:
        t = mono()
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = None
        return rc, mono() - t


class Run:
    """What every stage needs: the arguments, the mode, N, kvd, and the stages' deadlines."""

    def __init__(self, args, n: int) -> None:
        self.args, self.n = args, n
        self.mode = "host" if args.host else "cuda"
        self.kvd: Kvd | None = None
        self.stages: list[int] = []
        self.end = mono() + args.budget_s
        self.torch = None
        if self.mode == "cuda":
            import torch

            self.torch = torch

    def deadline(self, stage: int) -> float:
        """The stage's own timeout, cut so that every later stage keeps LATER_STAGE_S of the
        run's budget."""
        own = {1: 60 + 15 * self.n, 2: 60, 3: 60, 4: 60}[stage] * self.args.timeout_scale
        later = sum(1 for s in self.stages if s > stage)
        return min(mono() + own, self.end - LATER_STAGE_S * later)

    def rank_cfg(self, ordinal: int, **kw) -> dict:
        return {"mode": self.mode, "url": self.kvd.url, "ordinal": ordinal} | kw

    def free_by_gpu(self) -> list[int]:
        if self.torch is None:
            return []
        return [self.torch.cuda.mem_get_info(g)[0] for g in range(self.n)]

    def warm_up(self) -> None:
        """Has kvd open every GPU (context, copy worker) before a baseline is taken: one small
        cache per GPU registered from this process, one chunk round-tripped bit-exact."""
        from kvmem import make_cache

        client = _client({"url": self.kvd.url}, "warm-up")
        for g in range(self.n):
            cache = make_cache(self.mode, "BLNHC", geometry("llama-3.1-8b", {"mode": self.mode}), 2 * CHUNK // 16, g)
            cache.fill(g)
            region = Region(client, cache, FP_WARM + g, 0)
            pipeline(region, "store", [(0, region.chunks(0, 1, 1), 0)], 1)
            cache.poison(CHUNK // 16, CHUNK // 16)
            time.sleep(0.05)
            rt = pipeline(region, "retrieve", [(0, region.chunks(CHUNK // 16, 1, 1), 0)], 1)
            cache.sync()
            if rt["copied"] != 1 or not cache.same(0, CHUNK // 16, CHUNK // 16):
                raise RuntimeError(f"warm-up round trip on GPU {g} failed")
            region.close()
            cache.close()
        del client
        time.sleep(0.2)

    def host_memory_hint(self) -> None:
        """CPU copy bandwidth of this host (torch, all threads) as a rough yardstick for DRAM."""
        torch = self.torch
        try:
            torch.set_num_threads(os.cpu_count() or 1)
            a = torch.empty(2 * GIB, dtype=torch.uint8)
            b = torch.empty(2 * GIB, dtype=torch.uint8)
            a.fill_(1)
            b.copy_(a)
            n, t0 = 0, mono()
            while mono() - t0 < 1.0:
                b.copy_(a)
                n += 1
            rate = n * 2 * GIB / (mono() - t0) / 1e9
            del a, b
            print(f"Host memory yardstick: a {os.cpu_count()}-thread CPU copy (torch) moves {rate:.0f} GB/s "
                  f"(≈{2 * rate:.0f} GB/s of DRAM reads + writes); NUMA nodes: {numa_nodes()}.")
        except Exception as e:
            print(f"Host memory yardstick: not measured ({e}).")


def numa_nodes() -> str:
    try:
        nodes = sorted(d for d in os.listdir("/sys/devices/system/node") if d.startswith("node"))
        return f"{len(nodes)} ({', '.join(nodes)})"
    except OSError:
        return "unknown"


def grow_memory(need_bytes: int, timeout_s: float) -> list[subprocess.Popen]:
    """Touches memory until /proc/meminfo's MemTotal reaches `need_bytes` or `timeout_s` passes.

    Some VMs (the device machines here) start with a small MemTotal that grows as memory is
    used, and kvd refuses a pool above MemTotal. The touching processes keep their memory
    until the caller ends them (once kvd has read MemTotal)."""
    total = meminfo_bytes("MemTotal")
    if total >= need_bytes:
        return []
    workers = max(1, min(8, os.cpu_count() or 1))
    each_gib = max(1, -(-(need_bytes - total) // GIB // workers))
    # A filler touches a GiB only while MemAvailable is above 8 GiB, else waits for the machine
    # to grow (or for the caller to end it), so touching never feeds the OOM killer.
    code = ("import sys, time\nheld = []\n"
            "def avail():\n    for l in open('/proc/meminfo'):\n        if l.startswith('MemAvailable:'):\n"
            "            return int(l.split()[1]) << 10\n    return 0\n"
            "for _ in range(int(sys.argv[1])):\n    while avail() < 8 << 30:\n        time.sleep(0.2)\n"
            "    held.append(b'\\x01' * (1 << 30))\ntime.sleep(3600)\n")
    fillers = [subprocess.Popen([sys.executable, "-c", code, str(each_gib)], stdout=subprocess.DEVNULL) for _ in range(workers)]
    t0 = changed = mono()
    last = total
    # Until MemTotal suffices, time is up, or it has not grown for 15 s (a machine whose memory
    # is what it is).
    while (now := meminfo_bytes("MemTotal")) < need_bytes and mono() - t0 < timeout_s and mono() - changed < 15:
        if now != last:
            last, changed = now, mono()
        time.sleep(0.2)
    print(f"# MemTotal {total / GIB:.0f} GiB -> {meminfo_bytes('MemTotal') / GIB:.0f} GiB after touching memory for "
          f"{mono() - t0:.1f} s ({workers} processes; kvd's pool needs {need_bytes / GIB:.0f} GiB)", flush=True)
    return fillers


def machine_header(run: Run) -> None:
    print(f"# kvd multi-GPU benchmark, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, mode {run.mode}, N = {run.n}, "
          f"{os.cpu_count()} CPUs, MemTotal {meminfo_bytes('MemTotal') / GIB:.0f} GiB, NUMA nodes {numa_nodes()}")
    if run.mode != "cuda":
        return
    t = run.torch
    print(f"# torch {t.__version__}, {t.cuda.device_count()} GPUs visible: {t.cuda.get_device_name(0)}")
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=10).stdout.strip().splitlines()
        for line in q:
            idx, bus, drv = (x.strip() for x in line.split(","))
            node = "?"
            try:
                node = open(f"/sys/bus/pci/devices/{bus.lower()[4:] if len(bus) > 12 else bus.lower()}/numa_node").read().strip()
            except OSError:
                pass
            print(f"# GPU {idx}: PCI {bus}, NUMA node {node}, driver {drv}")
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
        print("```\n" + topo.rstrip() + "\n```")
    except Exception as e:
        print(f"# nvidia-smi: {e}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kvd", required=True, help="the kvd binary")
    ap.add_argument("--host", action="store_true",
                    help=f"host memory (kvd.HostBuffer), no torch or GPU; small requests, at most {HOST_LAYERS} layers")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs (and rank processes) to use (default: all visible; 2 with --host)")
    ap.add_argument("--stages", default="1,2,3,4")
    ap.add_argument("--pool-gib", type=float, default=0, help="kvd's pool (default: 24 GiB per GPU + 8, or 0.25 with --host)")
    ap.add_argument("--seconds", type=float, default=None, help="stage 1's run per layout (default 4, 1 with --host)")
    ap.add_argument("--ceiling-seconds", type=float, default=0.6, help="each copy ceiling's timed span")
    ap.add_argument("--layouts", default="BLNHC,LBNHC")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per request (default 8192, 512 with --host)")
    ap.add_argument("--inflight", type=int, default=None, help="requests in flight per direction (default 8, 2 with --host)")
    ap.add_argument("--requests", type=int, default=None, help="requests per rank in stages 2 and 3 (default 8, 2 with --host)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of stages 2 and 3 (default 3, 1 with --host)")
    ap.add_argument("--kill-blocks", type=int, default=None, help="blocks of each stage-4 cache (2 MiB each; default 1024, 64 with --host)")
    ap.add_argument("--slack-mib", type=int, default=128, help="stage 4: GPU memory within this of the baseline counts as released")
    ap.add_argument("--no-vmm", action="store_true", help="stage 4 without the expandable-segments client")
    ap.add_argument("--kvd-log", default=None, help="write kvd's log here")
    ap.add_argument("--kvd-start-timeout-s", type=float, default=120)
    ap.add_argument("--grow-memory-s", type=float, default=90, help="at most this long touching memory so that MemTotal covers the pool")
    ap.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every stage's timeout")
    ap.add_argument("--budget-s", type=float, default=360, help="the whole run's time; a stage that would start with "
                    f"less than {LATER_STAGE_S} s left is skipped")
    args = ap.parse_args()
    host = args.host
    for name, gpu_default, host_default in (("seconds", 4.0, 1.0), ("tokens", 8192, 512), ("inflight", 8, 2), ("requests", 8, 2),
                                            ("rounds", 3, 1), ("kill_blocks", 1024, 64)):
        if getattr(args, name) is None:
            setattr(args, name, host_default if host else gpu_default)
    if args.tokens % CHUNK:
        ap.error(f"--tokens {args.tokens}: requests are whole {CHUNK}-token chunks; pass a multiple of {CHUNK}")
    stages = [int(s) for s in args.stages.split(",") if s]
    if any(s not in STAGES for s in stages):
        ap.error(f"--stages {args.stages}: pick from 1,2,3,4")

    if not (os.path.isfile(args.kvd) and os.access(args.kvd, os.X_OK)):
        ap.error(f"--kvd {args.kvd}: no such executable; build it (cargo build -p kvd-server) or pass its path")
    signal.signal(signal.SIGTERM, _on_sigterm)
    t_start = mono()
    n = args.gpus or 2
    run = Run(args, n)
    run.stages = stages
    if not host:
        have = run.torch.cuda.device_count()
        n = args.gpus or have
        if have == 0 or n > have:
            print(f"multigpu: {have} GPU(s) visible, {n} asked for; pass --gpus {have} or --host", file=sys.stderr)
            return 2
        run.n = n
    need_blocks = 2 * kill_chunks(host) * CHUNK // 16
    if args.kill_blocks < need_blocks:
        ap.error(f"--kill-blocks {args.kill_blocks}: stage 4 stores and retrieves {kill_chunks(host)} chunks; pass at least {need_blocks}")
    pool = args.pool_gib or (0.25 if host else 24.0 * n + 8)
    machine_header(run)
    if host:
        print(f"# --host: every cache keeps its geometry's shape with at most {HOST_LAYERS} layers; speeds mean nothing here")
    fillers = [] if host else grow_memory(int((pool + 4) * GIB), min(args.grow_memory_s, args.budget_s / 4))
    allowed = meminfo_bytes("MemTotal") / GIB - 2
    if pool > allowed:
        print(f"# MemTotal allows kvd a pool of at most {allowed:.0f} GiB, not {pool:g}: using {allowed:.0f} GiB "
              "(stage 1 may find its chunks evicted or refused; pass --pool-gib to choose)", flush=True)
        pool = float(int(allowed))

    def end_fillers() -> None:
        for f in fillers:
            f.kill()
        for f in fillers:
            f.wait()
        fillers.clear()

    results: list[tuple[int, str, float, str]] = []
    try:
        run.kvd = Kvd(args, pool, on_first_line=end_fillers)
    except Exception as e:
        print(f"multigpu: {e}", file=sys.stderr)
        return 2
    finally:
        end_fillers()
    try:
        print(f"# kvd {args.kvd} pid {run.kvd.pid}: pool {pool:g} GiB, ready {mono() - t_start:.1f} s after the start; {run.kvd.url}, http {run.kvd.http}",
              flush=True)
        for s in stages:
            title, fn = STAGES[s]
            t = mono()
            if run.end - t < LATER_STAGE_S:
                results.append((s, "SKIPPED", 0.0, f"less than {LATER_STAGE_S} s of --budget-s {args.budget_s:g} left"))
                continue
            print(f"\n## Stage {s}: {title}", flush=True)
            try:
                if not run.kvd.alive():
                    print(f"kvd had exited (code {run.kvd.proc.returncode}); starting it again")
                    run.kvd = Kvd(args, pool)
                problems = fn(run)
                results.append((s, "FAILED" if problems else "ok", mono() - t, "; ".join(problems)))
                if problems:
                    print(f"\n**stage {s} failed**: " + "; ".join(problems), flush=True)
            except Interrupted:
                results.append((s, "INTERRUPTED", mono() - t, "SIGTERM"))
                break
            except Exception as e:
                results.append((s, "ERROR", mono() - t, f"{type(e).__name__}: {e}"))
                print(f"\n**stage {s} error**: {type(e).__name__}: {e}", flush=True)
            sys.stdout.flush()
    finally:
        rc, took = run.kvd.stop() if run.kvd else (None, 0.0)
    print("\n## Summary\n")
    print("| stage | result | seconds | note |")
    print("|---|---|---|---|")
    for s, res, secs, note in results:
        print(f"| {s}: {STAGES[s][0]} | **{res}** | {secs:.1f} | {note.replace('|', '/')} |")
    clean = rc == 0 and took < 5
    print(f"| kvd exit on SIGTERM | **{'ok' if clean else 'FAILED'}** | {took:.1f} | exit code {rc} |")
    print(f"\nTotal {mono() - t_start:.0f} s.")
    return 0 if clean and all(r[1] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
