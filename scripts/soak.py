#!/usr/bin/env python3
"""Soak with faults: many clients hammer one kvd whose pool is far smaller than what they store,
while clients are SIGKILLed and restarted and kvd itself is SIGKILLed and restarted once.

Every chunk's contents derive from its key (salt, hash), so any byte read back can be checked
wherever it came from: 0 corrupt bytes is the first verdict. At the end, with the clients still
connected but quiet, kvd must hold no pins and exactly the live clients' registrations; once they
exit, none. kvd's RSS is sampled and must stay flat, and what the clients saw (store and
retrieve outcomes, error replies) must agree with kvd's counters.

    scripts/soak.py [--minutes 10] [--clients 8] [--pool-mb 64] [--kvd target/release/kvd]
    scripts/soak.py --cuda ...      # GPU memory: torch tensors registered like vLLM's KV cache

Needs the `kvd` package (pip install ./connector-py; `--cuda` also torch). Exits 0 only when
every check holds; prints one table of checks and writes it as JSON to --report.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One chunk: 4 blocks of 16 tokens; a block of all 4 layers (BLNHC, 2 heads of 64 bf16) is 16 KiB,
# so a page is 64 KiB.
LAYERS, HEADS, BLOCK_TOKENS, CONTENT, ELEM = 4, 2, 16, 64, 2
CHUNK_TOKENS = 64
CHUNK_BLOCKS = CHUNK_TOKENS // BLOCK_TOKENS
BLOCK_BYTES = LAYERS * HEADS * BLOCK_TOKENS * CONTENT * ELEM
PAGE_BYTES = CHUNK_BLOCKS * BLOCK_BYTES
CACHE_BLOCKS = 64  # per client: 1 MiB
MAX_CHUNKS = 8  # per request
SEQ_CHUNKS = 32
FINGERPRINT = 0x50AC
SKIP = 0xFFFFFFFF
SENTINEL = 0xA5
STORE_OUTCOMES = ("stored", "already_stored", "refused_pool_full", "skipped")
RETRIEVE_OUTCOMES = ("loaded", "missing")


def key(seq: int, i: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"soak/{seq}/{i}".encode(), digest_size=16).digest(), "little")


def expected(salt: int, h: int, j: int) -> bytes:
    """Block j of the chunk keyed (salt, h): every byte follows from the key."""
    return hashlib.shake_256(salt.to_bytes(8, "little") + h.to_bytes(16, "little") + bytes([j])).digest(BLOCK_BYTES)


# ------------------------------------------------------------------------------------ client


class Cache:
    """One client's KV cache: host memory (a memfd) or a CUDA tensor, BLNHC like vLLM's."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        shape = (CACHE_BLOCKS, HEADS, BLOCK_TOKENS, CONTENT)
        # BLNHC in elements: block, layer, token, head, content.
        strides = (LAYERS * HEADS * BLOCK_TOKENS * CONTENT, CONTENT, HEADS * CONTENT, 1)
        layer_elems = HEADS * BLOCK_TOKENS * CONTENT
        if cuda:
            import torch

            self.torch = torch
            self.buf = torch.zeros(CACHE_BLOCKS * BLOCK_BYTES, dtype=torch.uint8, device="cuda")
            typed = self.buf.view(torch.bfloat16)
            self.views = [typed.as_strided(shape, strides, l * layer_elems) for l in range(LAYERS)]
        else:
            from kvd.testing import vllm_cache

            self.buf, self.views = vllm_cache("BLNHC", LAYERS, CACHE_BLOCKS, HEADS, BLOCK_TOKENS, CONTENT, ELEM)

    def write(self, block: int, data: bytes) -> None:
        if self.cuda:
            src = self.torch.frombuffer(bytearray(data), dtype=self.torch.uint8)
            self.buf[block * BLOCK_BYTES:(block + 1) * BLOCK_BYTES].copy_(src)
        else:
            self.buf.write(block * BLOCK_BYTES, data)

    def read(self, block: int) -> bytes:
        if self.cuda:
            return self.buf[block * BLOCK_BYTES:(block + 1) * BLOCK_BYTES].cpu().numpy().tobytes()
        return self.buf.read(block * BLOCK_BYTES, BLOCK_BYTES)

    def stream(self) -> int:
        return int(self.torch.cuda.current_stream().cuda_stream) if self.cuda else 0


def diff_bytes(a: bytes, b: bytes) -> int:
    if a == b:
        return 0
    return sum(x != y for x, y in zip(a, b))


class Worker:
    """The loop one client process runs."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvd import _native
        from kvd.layout import describe

        self.native = _native
        self.args = args
        self.dir = Path(args.dir)
        self.rng = random.Random(os.getpid() ^ time.monotonic_ns())
        self.cache = Cache(args.cuda)
        self.spec = describe(self.cache.views)
        self.client = None
        self.reg = None
        self.stats: dict[str, float] = {"pid": os.getpid(), "slot": args.client}
        self.epoch = -1
        self.stats_path = self.dir / f"client-{args.client}-{os.getpid()}.json"
        self.free = list(range(CACHE_BLOCKS))
        self.slot = 0

    def count(self, name: str, n: int = 1) -> None:
        """Counts under the current kvd epoch, so totals can be matched with one kvd's metrics."""
        k = f"e{self.epoch}.{name}"
        self.stats[k] = self.stats.get(k, 0) + n
        self.stats[name] = self.stats.get(name, 0) + n

    def flush(self) -> None:
        tmp = self.stats_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.stats))
        os.replace(tmp, self.stats_path)

    def connect(self) -> None:
        backoff = 0.1
        while True:
            try:
                self.epoch = int((self.dir / "epoch").read_text())
                self.client = self.native.Client(self.args.url, f"soak-{self.args.client}", role="worker",
                                                 connect_timeout=2.0, request_timeout=10.0)
                self.reg = self.client.register(FINGERPRINT, 0, "cuda" if self.args.cuda else "host",
                                                self.spec.layer_ptrs, self.spec.layout, events=16)
                assert self.reg.page_bytes == PAGE_BYTES, self.reg.page_bytes
                return
            except (self.native.KvdError, TimeoutError) as e:
                if isinstance(e, self.native.ServerError):
                    self.count(f"error.{e.args[0]}")
                self.stats["last_connect_error"] = str(e)[:200]
                self.count("connect_failures")
                self.flush()
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def event(self) -> int | None:
        if not self.args.cuda:
            return None
        slot = self.slot % self.reg.num_events
        self.slot += 1
        self.reg.record(slot, self.cache.stream())
        return slot

    def wait(self, done_slot: int | None) -> None:
        if done_slot is not None:
            self.reg.synchronize(done_slot)

    def op_store(self) -> None:
        seq, salt = self.rng.randrange(self.args.seqs), self.rng.randrange(2)
        n = self.rng.randint(1, MAX_CHUNKS)
        start = self.rng.randrange(SEQ_CHUNKS - n + 1)
        blocks = self.rng.sample(self.free, n * CHUNK_BLOCKS)
        chunks = []
        for i in range(n):
            h = key(seq, start + i)
            bs = blocks[i * CHUNK_BLOCKS:(i + 1) * CHUNK_BLOCKS]
            for j, b in enumerate(bs):
                self.cache.write(b, expected(salt, h, j))
            chunks.append((h, bs))
        outcomes, done = self.client.store(self.reg.region, salt, chunks, wait_slot=self.event()).result(15)
        self.wait(done)
        if len(outcomes) != n or any(o > 3 for o in outcomes):
            self.count("contract_violations")
        refused = False
        for o in outcomes:
            self.count(f"store.{STORE_OUTCOMES[min(o, 3)]}")
            if refused and o != 3:
                self.count("contract_violations")  # every chunk after a refusal is skipped
            refused |= o == 2

    def op_retrieve(self) -> None:
        seq, salt = self.rng.randrange(self.args.seqs), self.rng.randrange(2)
        n = self.rng.randint(1, MAX_CHUNKS)
        start = self.rng.randrange(SEQ_CHUNKS - n + 1)
        hashes = [key(seq, start + i) for i in range(n)]
        hit, pin = self.client.lookup(FINGERPRINT, salt, [0], hashes, pin=True).result(15)
        self.count("lookups")
        self.count("lookup.hit_chunks", hit)
        if hit > n:
            self.count("contract_violations")
            return
        # Retrieve the hits under the pin, and sometimes one more chunk without it.
        want = hit + (1 if hit < n and self.rng.random() < 0.3 else 0)
        if want == 0:
            return
        blocks = self.rng.sample(self.free, want * CHUNK_BLOCKS)
        skip = self.rng.random() < 0.1
        chunks = []
        for i in range(want):
            bs = list(blocks[i * CHUNK_BLOCKS:(i + 1) * CHUNK_BLOCKS])
            if skip and i == 0:
                bs[self.rng.randrange(CHUNK_BLOCKS)] = SKIP
            chunks.append((hashes[i], bs))
        for b in blocks:
            self.cache.write(b, bytes([SENTINEL]) * BLOCK_BYTES)
        sentinel = bytes([SENTINEL]) * BLOCK_BYTES
        outcomes, done = self.client.retrieve(self.reg.region, salt, chunks, pin_id=pin, wait_slot=self.event()).result(15)
        self.wait(done)
        if len(outcomes) != want:
            self.count("contract_violations")
            return
        for i, ((h, bs), o) in enumerate(zip(chunks, outcomes)):
            self.count(f"retrieve.{RETRIEVE_OUTCOMES[min(o, 1)]}")
            if o == 1 and i < hit:
                self.count("pinned_chunk_missing")
            for j, b in enumerate(bs):
                if b == SKIP:
                    continue
                got = self.cache.read(b)
                bad = diff_bytes(got, expected(salt, h, j) if o == 0 else sentinel)
                if bad:
                    self.count("corrupt_bytes", bad)
                    self.count("corrupt_blocks")
                self.count("bytes_checked", BLOCK_BYTES)
        # The retrieve that named the pin ended it (readers=1).

    def op_pin_release(self) -> None:
        seq = self.rng.randrange(self.args.seqs)
        start = self.rng.randrange(SEQ_CHUNKS - 4 + 1)
        hit, pin = self.client.lookup(FINGERPRINT, 0, [0], [key(seq, start + i) for i in range(4)], pin=True).result(15)
        self.count("lookups")
        self.count("lookup.hit_chunks", hit)
        if pin and self.rng.random() < 0.5:
            self.client.release(pin).result(15)
        elif pin:
            self.count("pins_abandoned")  # kvd must expire it (--pin-timeout-ms)

    def op_bad(self) -> None:
        """Requests kvd must refuse with an error reply: each is counted by code."""
        if self.rng.random() < 0.5:
            chunks = [(key(0, 0), [CACHE_BLOCKS + 5] + [0] * (CHUNK_BLOCKS - 1))]
            p = self.client.retrieve(self.reg.region, 0, chunks)
        else:
            p = self.client.store(self.reg.region + 1000, 0, [(key(0, 0), [0] * CHUNK_BLOCKS)])
        try:
            p.result(15)
            self.count("contract_violations")  # accepted
        except self.native.ServerError as e:
            self.count(f"error.{e.args[0]}")

    def run(self) -> None:
        self.connect()
        self.flush()
        ops = [(self.op_store, 40), (self.op_retrieve, 45), (self.op_pin_release, 10), (self.op_bad, 2)]
        funcs, weights = zip(*ops)
        quiet = False
        while not (self.dir / "exit").exists():
            if (self.dir / "quiesce").exists():
                if not quiet:
                    self.stats["quiet"] = 1
                    self.flush()
                    quiet = True
                time.sleep(0.1)
                continue
            op = self.rng.choices(funcs, weights)[0]
            try:
                op()
            except (self.native.ConnectionLost, TimeoutError) as e:
                self.count("connection_lost")
                self.stats["last_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                self.connect()
            except self.native.KvdError as e:
                # Busy, NotReady after a restart, ...: counted by code, then go on.
                self.count(f"error.{e.args[0] if e.args else type(e).__name__}")
                self.stats["last_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                if not self.client.connected():
                    self.connect()
            self.count("ops")
            self.flush()
        self.flush()


# ------------------------------------------------------------------------------------ parent


def kvd_binary(arg: str | None) -> str:
    if arg:
        return arg
    if os.environ.get("KVD_BIN"):
        return os.environ["KVD_BIN"]
    built = [p for p in (ROOT / "target" / prof / "kvd" for prof in ("release", "debug")) if p.exists()]
    if not built:
        sys.exit("soak.py: no kvd binary; build it with `cargo build --release -p kvd-server` or pass --kvd")
    return str(max(built, key=lambda p: p.stat().st_mtime))


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="kvd-soak-"))
        from kvd.testing import free_port  # below the ephemeral range: no connection takes it first

        self.port, self.http_port = free_port(), free_port()
        self.url = f"tcp://127.0.0.1:{self.port}"
        self.kvd: subprocess.Popen | None = None
        self.epoch = 0
        self.clients: dict[int, subprocess.Popen] = {}
        self.rss: list[tuple[float, int, int, int]] = []  # (t, epoch, VmRSS kB, RssAnon kB)
        self.kills = {"clients": 0, "kvd": 0}
        self.kills_by_epoch: dict[int, int] = {}
        self.log = open(self.dir / "kvd.log", "a")

    def start_kvd(self) -> None:
        tmp = self.dir / "epoch.tmp"
        tmp.write_text(str(self.epoch))
        os.replace(tmp, self.dir / "epoch")  # clients read it while it changes
        cmd = [kvd_binary(self.args.kvd), "serve", "--port", str(self.port), "--http-port", str(self.http_port),
               "--fd-socket", str(self.dir / "fd.sock"), "--l1-size-gb", str(self.args.pool_mb / 1024),
               "--chunk-tokens", str(CHUNK_TOKENS), "--pin-timeout-ms", "3000", "--session-timeout-ms", "5000",
               "--slab-mb", "8"]
        self.kvd = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.kvd.poll() is not None:
                sys.exit(f"soak.py: kvd exited with {self.kvd.returncode}; see {self.dir / 'kvd.log'}")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=1).status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        sys.exit(f"soak.py: kvd not healthy within 60 s; see {self.dir / 'kvd.log'}")

    def start_client(self, slot: int) -> None:
        cmd = [sys.executable, __file__, "--client", str(slot), "--dir", str(self.dir), "--url", self.url,
               "--seqs", str(self.args.seqs)] + (["--cuda"] if self.args.cuda else [])
        self.clients[slot] = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)

    def metrics(self) -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5).read().decode()
        out: dict[str, float] = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def sample_rss(self) -> None:
        try:
            status = Path(f"/proc/{self.kvd.pid}/status").read_text()
        except OSError:
            return
        kb = {l.split(":")[0]: int(l.split()[1]) for l in status.splitlines() if l.startswith(("VmRSS", "RssAnon"))}
        self.rss.append((time.monotonic(), self.epoch, kb.get("VmRSS", 0), kb.get("RssAnon", 0)))

    def client_stats(self) -> list[dict]:
        out = []
        for p in self.dir.glob("client-*.json"):
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError):
                pass
        return out

    def run(self) -> int:
        a = self.args
        print(f"soak: {a.clients} clients, pool {a.pool_mb} MiB, universe {a.seqs * SEQ_CHUNKS * PAGE_BYTES >> 20} MiB "
              f"per salt, {a.minutes} min, {'CUDA' if a.cuda else 'host'} memory; work dir {self.dir}", flush=True)
        self.start_kvd()
        for slot in range(a.clients):
            self.start_client(slot)
        start = time.monotonic()
        end = start + a.minutes * 60
        kvd_kill_at = start + a.minutes * 60 * 0.45
        next_kill = start + random.uniform(3, 2 * a.kill_every_s)
        next_rss = start
        while (now := time.monotonic()) < end:
            if now >= next_rss:
                self.sample_rss()
                next_rss = now + 2
            if self.kvd is not None and self.epoch == 0 and now >= kvd_kill_at:
                self.kvd.send_signal(signal.SIGKILL)
                self.kvd.wait()
                self.kills["kvd"] += 1
                self.epoch += 1
                print(f"soak: {now - start:6.1f}s SIGKILL kvd; restarting it", flush=True)
                self.start_kvd()
            if now >= next_kill:
                slot = random.randrange(a.clients)
                self.clients[slot].send_signal(signal.SIGKILL)
                self.clients[slot].wait()
                self.kills["clients"] += 1
                self.kills_by_epoch[self.epoch] = self.kills_by_epoch.get(self.epoch, 0) + 1
                time.sleep(random.uniform(0, 1))
                self.start_client(slot)
                next_kill = now + random.uniform(0.5, 2 * a.kill_every_s)
            for slot, p in self.clients.items():
                if p.poll() is not None:
                    print(f"soak: client {slot} exited by itself ({p.returncode}); see {self.dir / 'kvd.log'}", flush=True)
                    self.start_client(slot)
            time.sleep(0.05)
        return self.finish(start)

    def finish(self, start: float) -> int:
        a = self.args
        checks: list[tuple[str, bool, str]] = []
        (self.dir / "quiesce").touch()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            live = [s for s in self.client_stats() if any(s.get("pid") == p.pid for p in self.clients.values())]
            if len(live) == a.clients and all(s.get("quiet") for s in live):
                break
            time.sleep(0.2)
        # Pins left by lookups never retrieved expire after --pin-timeout-ms (3 s).
        deadline = time.monotonic() + 10
        m = self.metrics()
        while time.monotonic() < deadline and (m.get("kvd_lookup_pins", 1) or m.get("kvd_pool_pinned_pages", 1)):
            time.sleep(0.5)
            m = self.metrics()
        checks.append(("pins back to 0 at quiescence", m.get("kvd_lookup_pins") == 0 and m.get("kvd_pool_pinned_pages") == 0,
                       f"kvd_lookup_pins {m.get('kvd_lookup_pins')}, kvd_pool_pinned_pages {m.get('kvd_pool_pinned_pages')}"))
        checks.append(("registrations = live clients", m.get("kvd_registered_workers") == a.clients and m.get("kvd_sessions") == a.clients,
                       f"kvd_registered_workers {m.get('kvd_registered_workers')}, kvd_sessions {m.get('kvd_sessions')}, live clients {a.clients}"))
        for p in self.clients.values():
            if p.poll() is not None:
                pass
        stats = self.client_stats()
        (self.dir / "exit").touch()
        for p in self.clients.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        time.sleep(1.0)
        m_end = self.metrics()
        checks.append(("no registrations after the clients exit", m_end.get("kvd_registered_workers") == 0 and m_end.get("kvd_sessions") == 0,
                       f"kvd_registered_workers {m_end.get('kvd_registered_workers')}, kvd_sessions {m_end.get('kvd_sessions')}"))

        total = lambda k: sum(s.get(k, 0) for s in stats)  # noqa: E731
        checked_mb = total("bytes_checked") / 2**20
        checks.append(("0 corrupt bytes read back", total("corrupt_bytes") == 0 and checked_mb > 0,
                       f"{int(total('corrupt_bytes'))} corrupt bytes in {int(total('corrupt_blocks'))} blocks; {checked_mb:.0f} MiB checked"))
        checks.append(("protocol contract held", total("contract_violations") == 0 and total("pinned_chunk_missing") == 0,
                       f"{int(total('contract_violations'))} violations, {int(total('pinned_chunk_missing'))} pinned chunks missing"))

        # kvd's counters of the last incarnation against what the clients saw in it. A killed
        # client may lose its last request's counts (kvd counted it, the client had not yet
        # written them): at most MAX_CHUNKS per kill.
        e = self.epoch
        slack = self.kills_by_epoch.get(e, 0) * MAX_CHUNKS
        ep = lambda k: total(f"e{e}.{k}")  # noqa: E731
        pairs = [(f"store.{o}", f'kvd_store_chunks_total{{outcome="{o}"}}') for o in STORE_OUTCOMES]
        pairs += [(f"retrieve.{o}", f'kvd_retrieve_chunks_total{{outcome="{o}"}}') for o in RETRIEVE_OUTCOMES]
        codes = sorted({k.split(".", 2)[2] for s in stats for k in s if k.startswith(f"e{e}.error.")})
        for code in codes:
            pairs.append((f"error.{code}", f'kvd_request_errors_total{{code="{code}"}}'))
        mismatched = []
        for mine, theirs in pairs:
            seen, counted = ep(mine), sum(v for k, v in m_end.items() if k.startswith(theirs.split("{")[0]) and all(
                part in k for part in theirs[theirs.index("{") + 1:-1].split(",")))
            if not (seen <= counted <= seen + slack):
                mismatched.append(f"{mine}: clients {int(seen)}, kvd {int(counted)}")
        checks.append(("clients' outcomes and errors = kvd's counters", not mismatched,
                       "; ".join(mismatched) if mismatched else f"{len(pairs)} counters agree (slack {slack} for {self.kills_by_epoch.get(e, 0)} kills)"))
        abandoned = ep("pins_abandoned")
        expired = m_end.get("kvd_pins_expired_total", 0)
        checks.append(("abandoned pins expire, counted", 0 < expired <= abandoned + slack or abandoned == 0,
                       f"{int(abandoned)} abandoned by live clients, kvd_pins_expired_total {int(expired)}"))

        # RSS: within the last incarnation, from a quarter of its life on (the pool is populated
        # at start and the clients' first registrations map their memory).
        last = [r for r in self.rss if r[1] == e]
        if len(last) >= 8:
            warm = last[len(last) // 4]
            peak = max(r[2] for r in last[len(last) // 4:])
            grow_kb = peak - warm[2]
            anon = [r[3] for r in last[len(last) // 4:]]
            ok = grow_kb <= max(16 * 1024, warm[2] // 20)
            detail = (f"VmRSS {warm[2] >> 10} MiB after warm-up, peak {peak >> 10} MiB (+{grow_kb >> 10} MiB); "
                      f"RssAnon {min(anon) >> 10}-{max(anon) >> 10} MiB; {len(self.rss)} samples")
        else:
            ok, detail = False, f"only {len(last)} RSS samples"
        checks.append(("kvd RSS flat", ok, detail))

        summary = {
            "minutes": a.minutes, "clients": a.clients, "pool_mb": a.pool_mb, "cuda": a.cuda,
            "universe_mb": 2 * a.seqs * SEQ_CHUNKS * PAGE_BYTES >> 20,
            "client_kills": self.kills["clients"], "kvd_kills": self.kills["kvd"],
            "ops": int(total("ops")), "lookups": int(total("lookups")),
            "chunks_stored": int(total("store.stored")), "chunks_refused": int(total("store.refused_pool_full")),
            "chunks_loaded": int(total("retrieve.loaded")), "chunks_missing": int(total("retrieve.missing")),
            "evictions": int(m_end.get("kvd_evictions_total", 0)), "connection_lost": int(total("connection_lost")),
            "errors": {k: int(total(k)) for k in sorted({k for s in stats for k in s if k.startswith("error.")})},
            "checks": [{"check": c, "ok": ok, "detail": d} for c, ok, d in checks],
        }
        self.kvd.send_signal(signal.SIGTERM)
        self.kvd.wait(10)
        if a.report:
            Path(a.report).write_text(json.dumps(summary, indent=1))
        print(json.dumps({k: v for k, v in summary.items() if k != "checks"}))
        for c, ok, d in checks:
            print(f"{'PASS' if ok else 'FAIL'}  {c}: {d}")
        failed = sum(not ok for _, ok, _ in checks)
        print(f"{len(checks) - failed} passed, {failed} failed")
        return 1 if failed else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long the clients run (default 10)")
    p.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    p.add_argument("--pool-mb", type=int, default=64, help="kvd's pool (default 64 MiB)")
    p.add_argument("--seqs", type=int, default=0,
                   help="sequences of 32 chunks per salt (default: what makes 4x the pool over both salts)")
    p.add_argument("--kill-every-s", type=float, default=5.0, help="mean seconds between client SIGKILLs (default 5)")
    p.add_argument("--kvd", help="the kvd binary (default $KVD_BIN, else the newest in target/)")
    p.add_argument("--cuda", action="store_true", help="register CUDA tensors instead of host memory")
    p.add_argument("--report", help="also write the result as JSON here")
    # The client side (started by the parent):
    p.add_argument("--client", type=int, help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.seqs:
        args.seqs = max(1, 4 * args.pool_mb * 2**20 // (2 * SEQ_CHUNKS * PAGE_BYTES))
    if args.client is not None:
        Worker(args).run()
        return
    sys.exit(Soak(args).run())


if __name__ == "__main__":
    main()
