"""The rank processes of benches/multigpu.py — one per GPU, spawned afresh for each stage — and
the orchestrator's side of their pipes.

A rank registers its own KV cache with the node's one kvd, moves requests through it with
requests in flight (`pipeline`), compares every byte it moved, and reports to the orchestrator,
which decides when each step starts (a shared CLOCK_MONOTONIC instant) and reads the results.
With mode "host" the caches are kvd.HostBuffer memory and torch is never imported.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
import traceback

from gpubench import CHUNK, GEOMETRIES, GIB

STORED = 0
FP_S1, FP_MLA, FP_TP, FP_KILL, FP_WARM = 0x51_0000, 0x52_0000, 0x53_0000, 0x54_0000, 0x55_0000
HOST_LAYERS = 2  # --host caches keep each geometry's shape but at most this many layers


def geometry(name: str, cfg: dict) -> tuple:
    """GEOMETRIES[name], with at most HOST_LAYERS layers in host mode (bytes are checked in
    Python there)."""
    layers, heads, content, block = GEOMETRIES[name]
    return (min(layers, HOST_LAYERS) if cfg["mode"] == "host" else layers, heads, content, block)


def mono() -> float:
    return time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the machine


# --- rank processes ----------------------------------------------------------------------------


class Peer:
    """A rank's end of its pipe to the orchestrator."""

    def __init__(self, conn) -> None:
        self.conn = conn

    def ask(self, tag: str, payload=None) -> dict:
        """Reports `payload` under `tag` and waits for the next instruction."""
        self.conn.send((tag, payload))
        return self.conn.recv()


def _rank_entry(stage: str, rank: int, conn, cfg: dict) -> None:
    # Before anything imports torch: the allocator reads its settings once.
    os.environ.update(cfg.get("env", {}))
    try:
        RANK_MAIN[stage](Peer(conn), rank, cfg)
    except BaseException as e:  # report, then die: the orchestrator fails the stage
        where = traceback.extract_tb(e.__traceback__)[-1]
        conn.send(("error", f"{type(e).__name__}: {e} (at {os.path.basename(where.filename)}:{where.lineno})"))
        conn.close()
        os._exit(1)


class Ranks:
    """Rank processes (spawned, one per cfg) and the orchestrator's side of their pipes; every
    wait ends at the stage's deadline."""

    def __init__(self, stage: str, cfgs: list[dict], deadline: float) -> None:
        ctx = mp.get_context("spawn")
        self.deadline = deadline
        self.conns, self.procs = [], []
        for r, cfg in enumerate(cfgs):
            a, b = ctx.Pipe()
            p = ctx.Process(target=_rank_entry, args=(stage, r, b, cfg), daemon=True, name=f"{stage}-rank{r}")
            p.start()
            b.close()
            self.conns.append(a)
            self.procs.append(p)

    @property
    def n(self) -> int:
        return len(self.procs)

    def send(self, msg: dict, ranks=None) -> None:
        for r in ranks if ranks is not None else range(self.n):
            self.conns[r].send(msg)

    def gather(self, tag: str, ranks=None) -> list:
        """Each rank's next report, which must be `tag`, in rank order."""
        want = set(ranks if ranks is not None else range(self.n))
        got = {}
        while want:
            left = self.deadline - mono()
            if left <= 0:
                raise TimeoutError(f"rank(s) {sorted(want)} did not report {tag!r} before the stage's timeout")
            for c in multiprocessing.connection.wait([self.conns[r] for r in want], timeout=left):
                r = self.conns.index(c)
                try:
                    t, payload = c.recv()
                except EOFError:
                    self.procs[r].join(1)
                    raise RuntimeError(f"rank {r} exited (code {self.procs[r].exitcode}) before reporting {tag!r}") from None
                if t == "error":
                    raise RuntimeError(f"rank {r}: {payload}")
                if t != tag:
                    raise RuntimeError(f"rank {r} reported {t!r} where {tag!r} was due")
                got[r] = payload
                want.discard(r)
        return [got[r] for r in sorted(got)]

    def ask(self, msg: dict, tag: str, ranks=None) -> list:
        self.send(msg, ranks)
        return self.gather(tag, ranks)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send({"do": "exit"})
            except OSError:
                pass
        end = mono() + 5
        for p in self.procs:
            p.join(max(0.0, end - mono()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(5)


def _device(cfg: dict) -> int:
    """Makes the rank's GPU current (mode "cuda"); returns its ordinal."""
    ordinal = cfg.get("ordinal", 0)
    if cfg["mode"] == "cuda":
        import torch

        torch.cuda.set_device(ordinal)
        torch.empty(1, device=f"cuda:{ordinal}")
    return ordinal


def _client(cfg: dict, name: str, role: str = "worker"):
    from kvd import _native

    return _native.Client(cfg["url"], name, role=role, request_timeout=60)


class Region:
    """A registered cache and the requests moved through it: `per` blocks a chunk, each
    request's chunks on consecutive blocks."""

    def __init__(self, client, cache, fp: int, shard: int) -> None:
        self.client, self.cache = client, cache
        spec = cache.spec
        self.reg = client.register(fp, shard, cache.device, spec.layer_ptrs, spec.layout, events=64)
        self.reg_fp = fp
        self.per = CHUNK // cache.block_tokens
        self.slot = 0

    def chunks(self, first_block: int, base: int, n: int) -> list:
        return [(base + c, list(range(first_block + c * self.per, first_block + (c + 1) * self.per))) for c in range(n)]

    def _event(self) -> int | None:
        """Records the next client event on the current stream (None for host memory)."""
        if self.reg.num_events == 0:
            return None
        s = self.slot % self.reg.num_events
        self.slot += 1
        self.reg.record(s, self.cache.stream())
        return s

    def store(self, chunks: list):
        return self.client.store(self.reg.region, 0, chunks, wait_slot=self._event())

    def retrieve(self, chunks: list, pin: int = 0, ordered: bool = True):
        return self.client.retrieve(self.reg.region, 0, chunks, pin_id=pin, wait_slot=self._event() if ordered else None)

    def wait(self, pending) -> list[int]:
        outcomes, slot = pending.result(60)
        if slot is not None:
            self.reg.synchronize(slot)  # blocks in the driver without the GIL
        return list(outcomes)

    def close(self) -> None:
        self.client.unregister(self.reg.region)


def pipeline(region: Region, op: str, jobs, inflight: int, stop_at: float | None = None, ordered: bool = True) -> dict:
    """Runs `jobs` — (key, chunks, pin) — with up to `inflight` requests in flight until they
    run out or `stop_at` passes. Counts only chunks actually copied; remembers the last
    outcome of each key and which (key, chunk) pairs were loaded at least once."""
    st = {"requests": 0, "copied": 0, "missing": 0, "refused": 0, "loaded": set(), "last": {}}
    pending: collections.deque = collections.deque()
    jobs = iter(jobs)
    t0 = mono()
    more = True
    while True:
        while more and len(pending) < inflight and (stop_at is None or mono() < stop_at):
            job = next(jobs, None)
            if job is None:
                more = False
                break
            key, chunks, pin = job
            p = region.store(chunks) if op == "store" else region.retrieve(chunks, pin, ordered)
            pending.append((key, chunks, p))
        if not pending:
            break
        key, chunks, p = pending.popleft()
        outcomes = region.wait(p)
        st["requests"] += 1
        st["last"][key] = (chunks, outcomes)
        for ci, o in enumerate(outcomes):
            if o == 0:  # STORED or LOADED
                st["copied"] += 1
                if op == "retrieve":
                    st["loaded"].add((key, ci))
            elif op == "retrieve":
                st["missing"] += 1
            elif o in (2, 3):  # RefusedPoolFull, Skipped
                st["refused"] += 1
    st.update(t0=t0, t1=mono(), bytes=st["copied"] * region.reg.page_bytes)
    return st


def compare(cache, src_first: int, dst_first: int, per: int, nchunks: int, loaded: set | None) -> tuple[int, int]:
    """(chunks compared, chunks that differ) between two block ranges; with `loaded`, only
    those chunk indexes (the others were never copied)."""
    idx = range(nchunks) if loaded is None else sorted(loaded)
    if loaded is None or len(loaded) == nchunks:
        ok = cache.same(src_first, dst_first, per * nchunks)
        return nchunks, 0 if ok else sum(not cache.same(src_first + c * per, dst_first + c * per, per) for c in range(nchunks))
    return len(idx), sum(not cache.same(src_first + c * per, dst_first + c * per, per) for c in idx)


def _gbs(b: float, t: float) -> float:
    return b / t / 1e9 if t > 0 else 0.0


# --- stage 1: data plane on all GPUs at once ---------------------------------------------------


def rank_stage1(peer: Peer, rank: int, cfg: dict) -> None:
    from kvmem import Ceilings, make_cache

    mode = cfg["mode"]
    ordinal = _device(cfg)
    client = _client(cfg, f"s1-rank{rank}")
    geo = geometry("llama-3.1-8b", cfg)
    inflight, cpr = cfg["inflight"], cfg["tokens"] // CHUNK
    per = CHUNK // geo[3]
    bpr = cpr * per  # blocks per request
    ceil = Ceilings(ordinal) if mode == "cuda" else None
    msg = peer.ask("up", {"pid": os.getpid()})
    a = b = ra = rb = None
    pin = 0
    ran: dict = {}
    while msg["do"] != "exit":
        do = msg["do"]
        if do == "ceil":
            msg = peer.ask("ceil", ceil.run(msg["start_at"], msg["seconds"]))
        elif do == "drop_ceil":
            if ceil is not None:
                ceil.close()
            ceil = None
            msg = peer.ask("dropped")
        elif do == "setup":
            order = msg["order"]
            a = make_cache(mode, order, geo, 2 * inflight * bpr, ordinal)  # stored from
            b = make_cache(mode, order, geo, 2 * inflight * bpr, ordinal)  # retrieved into
            a.fill(100 + rank)
            b.fill(200 + rank)
            tag = (rank << 8) | ("BLNHC", "LBNHC", "LBHNC", "LHBNC", "BLHNC", "BHLNC").index(order)
            ra = Region(client, a, FP_S1 | tag << 1, 0)
            rb = Region(client, b, FP_S1 | tag << 1 | 1, 0)
            # What the retrieves read: slot s of b under keys (s + 1) << 32; retrieves land in
            # slot s + inflight.
            prime = pipeline(rb, "store", [(s, rb.chunks(s * bpr, (s + 1) << 32, cpr), 0) for s in range(inflight)], inflight)
            if prime["copied"] != inflight * cpr:
                raise RuntimeError(f"priming stored {prime['copied']} of {inflight * cpr} chunks ({prime['refused']} refused): "
                                   "the pool is too small; pass a larger --pool-gib")
            time.sleep(0.1)  # kvd marks chunks stored once its completion thread saw the copy
            # A lookup pin keeps what the retrieves read from being evicted by the stores (the
            # retrieves name no pin, so it holds until released at teardown).
            keys = [h for s in range(inflight) for h, _ in rb.chunks(s * bpr, (s + 1) << 32, cpr)]
            hit, pin = client.lookup(rb.reg_fp, 0, [0], keys, pin=True).result(10)
            if hit != len(keys):
                raise RuntimeError(f"a lookup found {hit} of the {len(keys)} chunks just stored")
            a.poison(inflight * bpr, inflight * bpr)
            b.poison(inflight * bpr, inflight * bpr)
            a.sync()
            b.sync()
            msg = peer.ask("ready", {"cache_gib": 2 * a.nbytes / GIB, "page_bytes": ra.reg.page_bytes})
        elif do == "go":
            stop_at = msg["start_at"] + msg["seconds"]

            def store_jobs():
                serial = 0
                while True:
                    s = serial % inflight
                    serial += 1
                    yield s, ra.chunks(s * bpr, serial << 32, cpr), 0

            def retrieve_jobs():
                i = 0
                while True:
                    s = i % inflight
                    i += 1
                    yield s, rb.chunks((s + inflight) * bpr, (s + 1) << 32, cpr), 0

            out: dict = {}

            def run(name, region, jobs) -> None:
                try:
                    out[name] = pipeline(region, name, jobs, inflight, stop_at, ordered=False)
                except Exception as e:
                    out[name] = e

            threads = [threading.Thread(target=run, args=("store", ra, store_jobs())),
                       threading.Thread(target=run, args=("retrieve", rb, retrieve_jobs()))]
            time.sleep(max(0.0, msg["start_at"] - mono()))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for v in out.values():
                if isinstance(v, Exception):
                    raise v
            ran = out
            msg = peer.ask("ran", {k: {x: v[x] for x in ("requests", "copied", "missing", "refused", "t0", "t1", "bytes")} for k, v in out.items()})
        elif do == "check":
            checked = bad = 0
            # Retrieves: each chunk loaded at least once holds what slot s was primed with.
            for s in range(inflight):
                loaded = {ci for key, ci in ran["retrieve"]["loaded"] if key == s}
                if loaded:
                    c, d = compare(b, s * bpr, (s + inflight) * bpr, per, cpr, loaded)
                    checked, bad = checked + c, bad + d
            # Stores: read each slot's last stored request back into slot s + inflight.
            readback_missing = 0
            for s, (chunks, outcomes) in ran["store"]["last"].items():
                stored_idx = [ci for ci, o in enumerate(outcomes) if o == STORED]
                if not stored_idx:
                    continue
                back = ra.chunks((s + inflight) * bpr, chunks[0][0], cpr)
                res = pipeline(ra, "retrieve", [(s, [back[ci] for ci in stored_idx], 0)], 1)
                got = {stored_idx[i] for key, i in res["loaded"]}
                readback_missing += len(stored_idx) - len(got)
                a.sync()
                if got:
                    c, d = compare(a, s * bpr, (s + inflight) * bpr, per, cpr, got)
                    checked, bad = checked + c, bad + d
            msg = peer.ask("checked", {"chunks": checked, "bad": bad, "readback_missing": readback_missing,
                                       "bytes": checked * ra.reg.page_bytes})
        elif do == "teardown":
            client.release(pin).result(10)
            for r in (ra, rb):
                r.close()
            for c in (a, b):
                c.close()
            a = b = ra = rb = None
            msg = peer.ask("down")
        else:
            raise RuntimeError(f"unknown instruction {do!r}")


# --- stage 2: MLA shared by N TP ranks ---------------------------------------------------------


def _mla_hashes(q: int, cpr: int) -> list[int]:
    return [(0x3A << 120) | (q << 32) | c for c in range(cpr)]


def rank_stage2(peer: Peer, rank: int, cfg: dict) -> None:
    from kvmem import make_cache

    ordinal = _device(cfg)
    client = _client(cfg, f"s2-rank{rank}")
    geo = geometry("deepseek-mla-b16", cfg)
    reqs, cpr = cfg["requests"], cfg["tokens"] // CHUNK
    per = CHUNK // geo[3]
    bpr = cpr * per
    cache = make_cache(cfg["mode"], "BLNHC", geo, 2 * reqs * bpr, ordinal)
    cache.fill(7)  # every rank holds the same MLA latent: what rank 0 stores is what all compare with
    # MLA: every rank registers shard 0; only rank 0 stores (the connector's WorkerGroup(store=rank == 0)).
    region = Region(client, cache, FP_MLA, 0)
    up: dict = {"page_bytes": region.reg.page_bytes, "shared_by": region.reg.shared_by}
    if rank == 0:
        st = pipeline(region, "store", [(q, region.chunks(q * bpr, _mla_hashes(q, 1)[0], cpr), 0) for q in range(reqs)], cfg["inflight"])
        if st["copied"] != reqs * cpr:
            raise RuntimeError(f"rank 0 stored {st['copied']} of {reqs * cpr} MLA chunks ({st['refused']} refused)")
        up.update(store_bytes=st["bytes"], store_s=st["t1"] - st["t0"])
    msg = peer.ask("up", up)
    while msg["do"] != "exit":
        if msg["do"] == "poison":
            cache.poison(reqs * bpr, reqs * bpr)
            cache.sync()
            msg = peer.ask("poisoned")
        elif msg["do"] == "read":
            time.sleep(max(0.0, msg.get("start_at", 0) - mono()))
            jobs = [(q, region.chunks((reqs + q) * bpr, _mla_hashes(q, 1)[0], cpr), pin) for q, pin in msg["reqs"]]
            st = pipeline(region, "retrieve", jobs, cfg["inflight"])
            cache.sync()
            checked = bad = 0
            for q, _ in msg["reqs"]:
                loaded = {ci for key, ci in st["loaded"] if key == q}
                c, d = compare(cache, q * bpr, (reqs + q) * bpr, per, cpr, loaded)
                checked, bad = checked + c, bad + d
            msg = peer.ask("read", {k: st[k] for k in ("t0", "t1", "bytes", "missing")} | {"checked": checked, "bad": bad})
        else:
            raise RuntimeError(f"unknown instruction {msg['do']!r}")
    region.close()


# --- stage 3: TP shards of a Llama-70B-like cache ----------------------------------------------


def _tp_hashes(k: int, q: int, cpr: int) -> list[int]:
    return [(0x70 << 120) | (k << 64) | (q << 32) | c for c in range(cpr)]


def rank_stage3(peer: Peer, rank: int, cfg: dict) -> None:
    from kvmem import make_cache

    ordinal = _device(cfg)
    client = _client(cfg, f"s3-rank{rank}")
    geo = geometry("llama-3.1-70b-tp8", cfg)
    reqs, cpr = cfg["requests"], cfg["tokens"] // CHUNK
    per = CHUNK // geo[3]
    bpr = cpr * per
    cache = make_cache(cfg["mode"], "BLNHC", geo, 2 * reqs * bpr, ordinal)
    cache.fill(1000 + rank)  # each shard its own bytes
    region = Region(client, cache, FP_TP, rank)
    msg = peer.ask("up", {"page_bytes": region.reg.page_bytes, "shared_by": region.reg.shared_by})
    while msg["do"] != "exit":
        do = msg["do"]
        time.sleep(max(0.0, msg.get("start_at", 0) - mono()))
        if do == "store":
            k = msg["round"]
            st = pipeline(region, "store", [(q, region.chunks(q * bpr, _tp_hashes(k, q, 1)[0], cpr), 0) for q in range(reqs)], cfg["inflight"])
            msg = peer.ask("stored", {x: st[x] for x in ("t0", "t1", "bytes", "copied", "refused")})
        elif do == "poison":
            cache.poison(reqs * bpr, reqs * bpr)
            cache.sync()
            msg = peer.ask("poisoned")
        elif do == "read":
            k = msg["round"]
            jobs = [(q, region.chunks((reqs + q) * bpr, _tp_hashes(k, q, 1)[0], cpr), pin) for q, pin in msg["reqs"]]
            st = pipeline(region, "retrieve", jobs, cfg["inflight"])
            cache.sync()
            checked = bad = 0
            for q, _ in msg["reqs"]:
                c, d = compare(cache, q * bpr, (reqs + q) * bpr, per, cpr, {ci for key, ci in st["loaded"] if key == q})
                checked, bad = checked + c, bad + d
            msg = peer.ask("read", {x: st[x] for x in ("t0", "t1", "bytes", "missing")} | {"checked": checked, "bad": bad})
        else:
            raise RuntimeError(f"unknown instruction {do!r}")
    region.close()


# --- stage 4: every rank SIGKILLed at once -----------------------------------------------------


def rank_stage4(peer: Peer, rank: int, cfg: dict) -> None:
    """Registers a cache, round-trips one request bit-exact, pins it with a lookup, and then
    holds everything until it is killed (cfg "hold") or reports and exits."""
    from kvmem import make_cache

    ordinal = _device(cfg)
    client = _client(cfg, f"s4-rank{rank}")
    geo = geometry("llama-3.1-8b", cfg)
    cpr = cfg["chunks"]
    per = CHUNK // geo[3]
    bpr = cpr * per
    cache = make_cache(cfg["mode"], "BLNHC", geo, cfg["blocks"], ordinal)
    cache.fill(400 + rank)
    fp = cfg["fp"]
    region = Region(client, cache, fp, 0)
    hashes = [(0x4B << 120) | (rank << 32) | c for c in range(cpr)]
    st = pipeline(region, "store", [(0, region.chunks(0, hashes[0], cpr), 0)], 1)
    cache.poison(bpr, bpr)
    time.sleep(0.05)
    rt = pipeline(region, "retrieve", [(0, region.chunks(bpr, hashes[0], cpr), 0)], 1)
    cache.sync()
    checked, bad = compare(cache, 0, bpr, per, cpr, {ci for _, ci in rt["loaded"]})
    hit, _pin = client.lookup(fp, 0, [0], hashes, pin=True).result(10)
    report = {"pid": os.getpid(), "gpu": ordinal, "shared_by": region.reg.shared_by, "cache_bytes": cache.nbytes,
              "stored": st["copied"], "checked": checked, "bad": bad, "hit": hit, "chunks": cpr}
    if not cfg["hold"]:
        region.close()
        peer.ask("done", report)
        return
    peer.ask("holding", report)  # waits here until killed


def kill_chunks(host: bool) -> int:
    """Chunks each stage-4 client stores, retrieves and pins."""
    return 2 if host else 8


RANK_MAIN = {"s1": rank_stage1, "s2": rank_stage2, "s3": rank_stage3, "s4": rank_stage4}
