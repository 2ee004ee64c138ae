#!/usr/bin/env python3
"""Replays real agentic (Claude Code) traces through kvd as vLLM 0.33 would drive it, checking
every loaded byte, and compares kvd's hit rate with Belady's MIN and an unbounded pool.

On a GPU host (torch, the kvd wheel, a kvd binary; figures go to benches/RESULTS.md):

    python3 benches/agentic.py --kvd target/release/kvd

Without a GPU (host memory shared with kvd by memfd; the CI test runs this on one small trace):

    python3 benches/agentic.py --kvd target/debug/kvd --host --traces trace_0598 --geometry tiny

Each trace is a user (sub-agent conversations are users of their own); every user sends its turns
in order, each after the previous one finished and the trace's think time passed (compressed,
``--step-s`` trace seconds per engine step, gaps capped by ``--max-gap-s``; a step that runs
nothing, only waiting for kvd's loads or stores, counts its wall time at ``--step-wall-ms`` a
step). An engine model
(``agentic_engine``) with a fixed number of KV blocks and vLLM's prefix cache schedules them and
calls kvd's ``KvdScheduler`` and ``KvdWorker`` as vLLM does. Tokens are scaled by
``--token-scale`` (``agentic_trace``): each 64-token trace block becomes 64/scale tokens and kvd's
chunk 256/scale tokens, so the chunk sequence kvd sees is the unscaled trace's. The replay is run
once per ``--eviction`` policy against a fresh kvd with the same pool, and the chunk events kvd
saw (lookups, stores) are replayed through Belady's MIN with the same number of pages and through
a pool that never evicts.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import agentic_trace as at  # noqa: E402
from agentic_engine import Engine, Request  # noqa: E402

from kvd.config import KvdConfig  # noqa: E402
from kvd.connection import Connection  # noqa: E402
from kvd.scheduler import GroupInfo, KvdScheduler  # noqa: E402
from kvd.worker import KvdWorker, WorkerGroup  # noqa: E402

#: The 48 traces of the recipes' benchmark, where this machine has them; else the three small
#: ones kept beside this file (for CI).
TRACES = "/work/shared/traces/agentic"
SMALL_TRACES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traces")
BLOCK = 16

# name: (layers, kv heads, content elements (K‖V, or the MLA latent), bf16 FLOPs per token of a
# forward pass = 2 × active parameters, what the geometry stands for)
# KV bytes per token = layers × heads × content × 2 (bf16). Llama-3.1-8B (its config.json on
# the Hugging Face hub, meta-llama/Llama-3.1-8B: num_hidden_layers 32, num_key_value_heads 8,
# head_dim 4096/32 = 128): 32 × 8 × (128 K + 128 V) × 2 = 128 KiB. DeepSeek-V3 (its config.json,
# deepseek-ai/DeepSeek-V3: num_hidden_layers 61, kv_lora_rank 512, qk_rope_head_dim 64; MLA caches
# one latent of 512 + 64 = 576 elements per layer, shared by all heads, as vLLM's MLA backends
# do): 61 × 576 × 2 = 70,272 B ≈ 68.6 KiB.
GEOMETRIES = {
    "llama-3.1-8b": (32, 8, 256, 2 * 8.0e9, "Llama-3.1-8B: 32 layers, 8 KV heads × 128 (K‖V), bf16, 128 KiB per token"),
    "deepseek-mla": (61, 1, 576, 2 * 37e9, "DeepSeek-V3 MLA: 61 layers, one 576-element latent, bf16, 68.6 KiB per token"),
    "tiny": (4, 2, 16, 2 * 1e9, "CI: 4 layers, 2 heads × 16 elements"),
}

K1, K2, K3 = 0x5851F42D4C957F2D, 0x14057B7EF767814F, 0x2545F4914F6CDD1D


def salts(layers: int, heads: int) -> np.ndarray:
    """One byte per (layer, head) mixed into the KV, so a block copied to the wrong layer or head
    is caught."""
    lh = np.arange(layers * heads, dtype=np.int64).reshape(layers, heads)
    return ((lh * 0x9E + 0x35) % 251 + 1).astype(np.uint8)


# --- KV memory -------------------------------------------------------------------------------


class HostKv:
    """The KV cache in host memory shared with kvd (a memfd), laid out as vLLM 0.33 lays it out,
    written and checked through a numpy view of the mapping."""

    def __init__(self, order: str, layers: int, blocks: int, heads: int, content: int, check_layers: int = 0) -> None:
        import ctypes

        from kvd.testing import vllm_cache

        self.buf, self.views = vllm_cache(order, layers, blocks, heads, BLOCK, content, elem=2)
        self.mem = np.ctypeslib.as_array((ctypes.c_uint8 * self.buf.size).from_address(self.buf.ptr))
        self.heads, self.cbytes = heads, content * 2
        self.cols = np.arange(self.cbytes, dtype=np.int64)
        self.salts = salts(layers, heads)
        self.checked_bytes = 0
        #: Layers whose bytes are written and checked (0: all). kvd copies whole pages either
        #: way; fewer layers only spares this process's numpy work, which at Llama's 128 KiB per
        #: token is what makes a host replay of the traces unaffordable on a small machine.
        self.check_layers = check_layers or layers

    def _bytes(self, seeds: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            x = seeds[:, None] * K1 + self.cols[None, :] * K2
            x ^= x >> 31
            x *= K3
        return ((x >> 40) & 0xFF).astype(np.uint8)

    def _runs(self, blocks: np.ndarray, offsets: np.ndarray):
        """(layer, head, byte index of every byte of those tokens' runs)."""
        for l, v in enumerate(self.views[:self.check_layers]):
            sb, sh, sn, _ = v.strides
            for h in range(self.heads):
                start = (v.offset + blocks * sb + h * sh + offsets * sn) * 2
                yield l, h, start[:, None] + self.cols[None, :]

    def write(self, blocks: np.ndarray, offsets: np.ndarray, seeds: np.ndarray) -> None:
        base = self._bytes(seeds)
        for l, h, idx in self._runs(blocks, offsets):
            self.mem[idx] = base ^ self.salts[l, h]

    def check(self, blocks: np.ndarray, offsets: np.ndarray, seeds: np.ndarray) -> int:
        base = self._bytes(seeds)
        bad = 0
        for l, h, idx in self._runs(blocks, offsets):
            bad += int((self.mem[idx] != (base ^ self.salts[l, h])).sum())
            self.checked_bytes += base.size
        return bad

    def registration(self):
        return self.views


class GpuKv:
    """The KV cache on the GPU: one buffer, per-layer [blocks, heads, tokens, content] bf16 views
    in ``order``, as vLLM 0.33's ``allocate_kv_cache`` makes them; written and checked by
    kernels on the current stream."""

    def __init__(self, order: str, layers: int, blocks: int, heads: int, content: int) -> None:
        import torch

        self.torch = torch
        size = {"L": layers, "B": blocks, "H": heads, "N": BLOCK, "C": content}
        stride, acc = {}, 1
        for c in reversed(order):
            stride[c] = acc
            acc *= size[c]
        self.buf = torch.zeros(acc * 2, dtype=torch.int8, device="cuda")
        typed = self.buf.view(torch.bfloat16)
        self.views = [torch.as_strided(typed, (blocks, heads, BLOCK, content), (stride["B"], stride["H"], stride["N"], stride["C"]), l * stride["L"]) for l in range(layers)]
        assert stride["C"] == 1, "content must be innermost"
        self.bytes_views = [torch.as_strided(self.buf, (blocks, heads, BLOCK, content * 2), (2 * stride["B"], 2 * stride["H"], 2 * stride["N"], 1), 2 * l * stride["L"]) for l in range(layers)]
        self.heads, self.cbytes = heads, content * 2
        self.salts = torch.from_numpy(salts(layers, heads).astype(np.int16)).cuda().to(torch.uint8)
        self.cols = torch.arange(self.cbytes, dtype=torch.int64, device="cuda") * K2
        self.checked_bytes = 0

    def _bytes(self, seeds):
        x = seeds[:, None] * K1 + self.cols[None, :]
        x ^= x >> 31
        x *= K3
        return ((x >> 40) & 0xFF).to(self.torch.uint8)

    def _pieces(self, blocks: np.ndarray, offsets: np.ndarray, seeds: np.ndarray, step: int = 32768):
        t = self.torch
        for i in range(0, len(seeds), step):
            yield (t.from_numpy(blocks[i:i + step]).cuda(non_blocking=True), t.from_numpy(offsets[i:i + step].astype(np.int64)).cuda(non_blocking=True),
                   self._bytes(t.from_numpy(seeds[i:i + step]).cuda(non_blocking=True)))

    def write(self, blocks: np.ndarray, offsets: np.ndarray, seeds: np.ndarray) -> None:
        for b, o, base in self._pieces(blocks, offsets, seeds):
            for l, v in enumerate(self.bytes_views):
                v[b, :, o, :] = (base[:, None, :] ^ self.salts[l][None, :, None]).view(self.torch.int8)

    def check(self, blocks: np.ndarray, offsets: np.ndarray, seeds: np.ndarray) -> int:
        bad = None
        for b, o, base in self._pieces(blocks, offsets, seeds):
            for l, v in enumerate(self.bytes_views):
                want = (base[:, None, :] ^ self.salts[l][None, :, None]).view(self.torch.int8)
                n = (v[b, :, o, :] != want).sum()
                bad = n if bad is None else bad + n
                self.checked_bytes += want.numel()
        return int(bad.item()) if bad is not None else 0

    def registration(self):
        return self.views


# --- what kvd saw ----------------------------------------------------------------------------


class Tap:
    """Records the chunk events the connector sends kvd (in the order sent) and kvd's lookup
    answers; forwards everything to the real client."""

    def __init__(self, exact: bool = False) -> None:
        #: Exact mode: a store or retrieve waits until kvd has answered every earlier lookup and
        #: release, so that kvd handles the events in the order they are recorded.
        self.exact = exact
        self.lookups: list[Any] = []
        self.events: list[at.Event] = []
        self.hits = 0
        self.asked = 0
        self.releases: list[Any] = []
        self.stores: list[Any] = []
        #: For the loss breakdown: every lookup's and store's answer by event index (read at the
        #: end when the connector did not read it), the stores not yet answered when each lookup
        #: was sent, and every retrieve with its chunks.
        self.answers: dict[int, _TapPending] = {}
        self.open_stores: list[tuple[int, _TapPending]] = []
        self.in_flight: dict[int, set[int]] = {}
        self.retrieves: list[tuple[_TapPending, list[int]]] = []
        #: Everything sent, in order, for ``--dump-events``: ("L", event index), ("S", event
        #: index), ("R", pin id, chunks), ("X", pin id).
        self.log: list[tuple] = []


class _TapPending:
    def __init__(self, inner, on_result=None) -> None:
        self.inner, self.on_result, self.seen, self.value = inner, on_result, False, None

    def done(self) -> bool:
        return self.seen or self.inner.done()

    def result(self, timeout=None):
        if self.seen:
            return self.value
        r = self.inner.result(timeout) if timeout is not None else self.inner.result()
        self.seen, self.value = True, r
        if self.on_result is not None:
            self.on_result(r)
        return r


class _TapClient:
    def __init__(self, inner, tap: Tap) -> None:
        self._inner, self._tap = inner, tap

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _in_order(self) -> None:
        if self._tap.exact:
            for p in self._tap.lookups + self._tap.releases:
                p.result(30)
            self._tap.lookups.clear()
            self._tap.releases.clear()

    def lookup(self, fingerprint, salt, shards, hashes, pin=True, readers=1, last=False, held=0):
        tap = self._tap
        i = len(tap.events)
        tap.events.append(("lookup", list(hashes)))
        n = len(hashes)

        def got(r) -> None:
            tap.hits += r[0]
            tap.asked += n

        tap.open_stores = [(j, s) for j, s in tap.open_stores if not s.done()]
        if tap.open_stores:
            tap.in_flight[i] = {j for j, _ in tap.open_stores}
        # (A state group's "last" lookup answers the last chunk held, not a prefix; the traces'
        # geometries have none.)
        inner = (self._inner.lookup(fingerprint, salt, shards, hashes, pin=pin, readers=readers, last=True) if last
                 else self._inner.lookup(fingerprint, salt, shards, hashes, pin=pin, readers=readers,
                                         **({"held": held} if held else {})))
        p = _TapPending(inner, got)
        tap.answers[i] = p
        tap.log.append(("L", i))
        if tap.exact:
            tap.lookups.append(p)
        return p

    def retrieve(self, region, salt, chunks, pin_id=0, wait_slot=None, deadline_ns=0):
        self._in_order()
        p = _TapPending(self._inner.retrieve(region, salt, chunks, pin_id=pin_id, wait_slot=wait_slot,
                                             deadline_ns=deadline_ns))
        self._tap.retrieves.append((p, [h for h, _ in chunks]))
        self._tap.log.append(("R", pin_id, [h for h, _ in chunks]))
        return p

    def store(self, region, salt, chunks, wait_slot=None, deadline_ns=0):
        self._in_order()
        tap = self._tap
        i = len(tap.events)
        tap.events.append(("store", [h for h, _ in chunks]))
        p = _TapPending(self._inner.store(region, salt, chunks, wait_slot=wait_slot, deadline_ns=deadline_ns))
        tap.answers[i] = p
        tap.log.append(("S", i))
        tap.open_stores.append((i, p))
        if tap.exact:
            tap.stores.append(p)
        return p

    def release(self, pin_id):
        self._tap.log.append(("X", pin_id))
        p = self._inner.release(pin_id)
        if self._tap.exact:
            self._tap.releases.append(p)
        return p


class TapConnection(Connection):
    """A connection whose client is seen through a Tap."""

    def __init__(self, tap: Tap, *a, **kw) -> None:
        self.tap = tap
        super().__init__(*a, **kw)

    def client(self):
        c = super().client()
        return None if c is None else _TapClient(c, self.tap)


# --- kvd -------------------------------------------------------------------------------------


class KvdProcess:
    def __init__(self, binary: str, pool_gib: float, chunk: int, policy: str, slab_mb: int | None, log_path: str | None,
                 extra: list[str] | None = None, disk: tuple[str, float] | None = None) -> None:
        self.fd = f"/tmp/kvd-agentic-{os.getpid()}-{time.monotonic_ns()}.fd.sock"
        cmd = [binary, "serve", "--l1-size-gb", f"{pool_gib:.6f}", "--port", "0", "--http-port", "0", "--fd-socket", self.fd,
               "--chunk-tokens", str(chunk), "--eviction", policy]
        if slab_mb:
            cmd += ["--slab-mb", str(slab_mb)]
        cmd += extra or []
        if disk:
            # A fresh disk tier per run: the file and its index from an earlier run are removed.
            path, gib = disk
            for f in (path, path + ".index"):
                if os.path.exists(f):
                    os.remove(f)
            cmd += ["--disk", path, "--disk-size-gb", f"{gib:.6f}"]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.url = self.http = ""
        self.log: list[str] = []
        log = open(log_path, "a") if log_path else None
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.log.append(line)
            if log:
                log.write(line)
            m = re.search(r"listening for clients on (tcp://\S+)", line)
            if m:
                self.url = m.group(1)
            m = re.search(r"serving /healthz and /metrics on http://(\S+)", line)
            if m:
                self.http = m.group(1)
            if "ready in" in line:
                break
        if not (self.url and self.http):
            raise RuntimeError("kvd did not start:\n" + "".join(self.log[-20:]))

        def drain() -> None:
            for line in self.proc.stderr:
                if log:
                    log.write(line)

        threading.Thread(target=drain, daemon=True).start()

    def metrics(self) -> dict[str, float]:
        body = urllib.request.urlopen(f"http://{self.http}/metrics", timeout=5).read().decode()
        out: dict[str, float] = {}
        for line in body.splitlines():
            if line.startswith("kvd_") and " " in line:
                name, value = line.rsplit(" ", 1)
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


# --- the replay ------------------------------------------------------------------------------


@dataclass
class User:
    conv: at.Conversation
    next_turn: int = 0
    ready_at: float = 0.0
    busy: bool = False
    parent: "User | None" = None
    #: The parent's turns that come before this sub-agent starts.
    after_parent_turns: int = 0


@dataclass
class Result:
    policy: str
    stats: Any
    tap_hits: int
    tap_asked: int
    events: list
    capacity_chunks: int
    page_bytes: int
    metrics: dict
    kvd_stats: dict
    wall_s: float
    turns: int
    worker_stats: dict
    checked_bytes: int
    #: Where kvd's hits fall short of MIN's (``breakdown``).
    loss: dict


def replay(args, convs: list[at.Conversation], tokens: at.Tokens, policy: str, geo, pool_gib: float, ceiling_note: str = "") -> Result:
    layers, heads, content = geo[0], geo[1], geo[2]
    chunk = 256 // args.token_scale
    disk = None
    if args.disk_dir:
        os.makedirs(args.disk_dir, exist_ok=True)
        disk = (os.path.join(args.disk_dir, "agentic.disk"), args.disk_gib)
    # "POLICY@BINARY": this replay runs another kvd binary (a before/after in one run).
    name, _, binary = policy.partition("@")
    kvd = KvdProcess(binary or args.kvd, pool_gib, chunk, name, args.slab_mb, args.kvd_log, args.kvd_arg, disk)
    try:
        cfg = KvdConfig(url=kvd.url, chunk_tokens=chunk, connect_timeout_s=5.0, request_timeout_s=60.0, lookup_timeout_s=30.0,
                        load_timeout_s=60.0, events=64,
                        # agentic_engine models vLLM's asynchronous load protocol only.
                        load_mode="async",
                        # The tap reads every lookup's answer (the hit rate, Belady's MIN on the
                        # events); a lookup kvd's presence filter answers goes unread, past the
                        # tap, and kvd keeps no filter with a disk: off, both arms ask alike.
                        presence=False)
        if args.host:
            mem = HostKv(args.layout, layers, args.gpu_blocks, heads, content, args.check_layers)
        else:
            mem = GpuKv(args.layout, layers, args.gpu_blocks, heads, content)
        tap = Tap(args.exact)
        fp = at.mix(len(args.layout), layers, heads, content, 7)
        if args.host:
            stream = lambda: 0  # noqa: E731
        else:
            import torch

            stream = lambda: int(torch.cuda.current_stream().cuda_stream)  # noqa: E731
        worker = KvdWorker(cfg, TapConnection(tap, cfg, "agentic-worker", "worker"), [WorkerGroup(fp, 0)], current_stream=stream)
        worker.register([mem.registration()])
        sched = KvdScheduler(cfg, [GroupInfo(fp, BLOCK, (0,), 1)], TapConnection(tap, cfg, "agentic-sched", "scheduler"))
        deadline = time.monotonic() + 30
        while not (worker.registrations and all(r is not None for r in worker.registrations) and sched.conn.client() is not None):
            if time.monotonic() > deadline:
                raise RuntimeError("the connector did not register with kvd")
            time.sleep(0.01)
        page_bytes = worker.registrations[0].page_bytes
        eng = Engine(sched, worker, mem, num_blocks=args.gpu_blocks, block_tokens=BLOCK, token_budget=args.token_budget,
                     max_seqs=args.max_seqs)
        users = [User(c) for c in convs]
        by_trace = {u.conv.name: u for u in users}
        for u in users:
            if u.conv.name != u.conv.trace:
                u.parent = by_trace[u.conv.trace]
                u.after_parent_turns = sum(1 for t in u.parent.conv.turns if t.t <= u.conv.start)
        clock, turns, serial = 0.0, 0, 0
        t0 = polled = time.perf_counter()

        def finished(u: User, req: Request) -> None:
            nonlocal turns
            u.busy = False
            turns += 1
            if u.next_turn < len(u.conv.turns):
                prev, nxt = u.conv.turns[u.next_turn - 1], u.conv.turns[u.next_turn]
                u.ready_at = clock + min(max(0.0, nxt.t - prev.t), args.max_gap_s)

        while True:
            pending = [u for u in users if not u.busy and u.next_turn < len(u.conv.turns)]
            if not pending and eng.idle():
                break
            for u in pending:
                if u.ready_at > clock or (u.parent is not None and u.parent.next_turn < u.after_parent_turns):
                    continue
                turn = u.conv.turns[u.next_turn]
                ids, seeds = tokens.prompt(u.conv.trace, turn)
                out = max(1, min(turn.tokens_out // args.token_scale, args.max_decode))
                seeds = np.concatenate([seeds, at.generated_seeds(seeds, out)])
                serial += 1
                u.next_turn += 1
                u.busy = True
                eng.add(Request(f"{u.conv.name}#{u.next_turn}-{serial}", ids.tolist(), seeds, len(ids), out, eng.stats.steps,
                                on_finish=lambda r, u=u: finished(u, r)))
            if eng.idle() and not eng.remote:
                waits = [u.ready_at for u in users if not u.busy and u.next_turn < len(u.conv.turns) and u.ready_at > clock]
                if waits:
                    clock = min(waits)
                    continue
            ran = eng.step()
            if args.exact:
                settle(eng, tap)
            elif not (eng.running or eng.waiting) and (eng.remote or eng.delayed):
                time.sleep(0.0002)
            now = time.perf_counter()
            if ran and eng.held and args.step_wall_ms > 0 and not args.exact:
                # Something ran while a request waits on kvd. This replay's steps run no model
                # (a few ms on a GPU host against a real engine's tens), so an unpadded wait
                # spans ~8x the steps it would in vLLM, each a whole --step-s of every user's
                # think time (session 26: a disk arm ran 8,270 steps against no disk's 4,640).
                rest = args.step_wall_ms / 1000 - (now - polled)
                if rest > 0:
                    time.sleep(rest)
                    now = time.perf_counter()
                eng.stats.padded_steps += 1
                eng.stats.padded_s += now - polled
            if ran or args.step_wall_ms <= 0:
                clock += args.step_s
            else:
                # Nothing ran: the engine only waited for kvd. A whole step per poll made a
                # 250 ms disk read pass ~1,000 steps of trace time (every user's think time
                # with it); wall time at the model's step length is what a real engine waits.
                clock += args.step_s * min(1.0, (now - polled) * 1000 / args.step_wall_ms)
            polled = now
        worker.shutdown()
        sched.conn.close()
        wall = time.perf_counter() - t0
        if not args.host:
            import torch

            torch.cuda.synchronize()
        conn = Connection(cfg, "agentic-stats", "tool")
        client = conn.client()
        kvd_stats = dict(client.stats()) if client else {}
        conn.close()
        pool_bytes = int(kvd_stats.get("pool_bytes_total", pool_gib * (1 << 30)))
        # kvd's slab size (server/src/config.rs): --slab-mb, but at most a sixteenth of a small
        # pool, in 2 MiB steps, never under 2 MiB.
        slab = min((args.slab_mb or 256) << 20, max(pool_bytes // 16 // (2 << 20) * (2 << 20), 2 << 20))
        capacity = (pool_bytes // slab) * (slab // page_bytes) if slab >= page_bytes else pool_bytes // page_bytes
        replies, retrieves = answers(tap)
        if args.dump_events:
            dump_events(f"{args.dump_events}.{policy.replace('/', '_')}.txt", tap, replies, capacity)
        loss = breakdown(tap.events, replies, tap.in_flight, retrieves, capacity)
        return Result(policy, eng.stats, tap.hits, tap.asked, tap.events, capacity, page_bytes, kvd.metrics(), kvd_stats, wall, turns,
                      dict(worker.stats), mem.checked_bytes, loss)
    finally:
        rc = kvd.stop()
        if rc != 0:
            print(f"# kvd exited with {rc}", file=sys.stderr)


def answers(tap: Tap) -> tuple[dict[int, Any], list[tuple[Any, list[int]]]]:
    """Every lookup's and store's answer by event index, and every retrieve's (the ones the
    connector did not read are read now; None for an answer that never came)."""

    def read(p):
        try:
            return p.result(30)
        except Exception:  # noqa: BLE001 - a lost answer is counted, not raised
            return None

    return {i: read(p) for i, p in tap.answers.items()}, [(read(p), keys) for p, keys in tap.retrieves]


def dump_events(path: str, tap: Tap, replies: dict[int, Any], capacity: int) -> None:
    """Writes what kvd was sent, in order, one line per request, chunks as small integers:
    ``P pages``, ``L pin hit c…`` (a lookup, its answer), ``S codes c…`` (a store, kvd's outcome
    per chunk as one digit each), ``R pin c…`` (a retrieve),
    ``X pin`` (a release). For replaying the same traffic offline through the cache."""
    ids: dict[int, int] = {}

    def cs(keys) -> str:
        return " ".join(str(ids.setdefault(k, len(ids))) for k in keys)

    with open(path, "w") as f:
        f.write(f"P {capacity}\n")
        for e in tap.log:
            if e[0] == "L":
                r = replies.get(e[1])
                hit, pin = (int(r[0]), int(r[1])) if r is not None else (0, 0)
                f.write(f"L {pin} {hit} {cs(tap.events[e[1]][1])}\n")
            elif e[0] == "S":
                r = replies.get(e[1])
                codes = "".join(str(min(int(o), 9)) for o in r[0]) if r is not None else "-"
                f.write(f"S {codes} {cs(tap.events[e[1]][1])}\n")
            elif e[0] == "R":
                f.write(f"R {e[1]} {cs(e[2])}\n")
            else:
                f.write(f"X {e[1]}\n")


def breakdown(events: list, replies: dict[int, Any], in_flight: dict[int, set[int]], retrieves: list, capacity: int) -> dict[str, int]:
    """Where kvd's hits fall short of MIN's on the same events, in chunks. For each lookup where
    kvd reported fewer chunks than MIN holds, the shortfall is put on the chunk where kvd's hit
    stopped: its last store was refused, or was not answered yet when the lookup was sent (still
    being written), or it was stored and kvd evicted it since (MIN kept it) — split by whether a
    lookup had reported it since its store (read) and whether kvd's hit stopped at the head.
    Also: chunks kvd hit beyond MIN's, lookups never answered, chunks a retrieve found gone
    (reported, then evicted before their load), and both hit counts over the first tenth of the
    lookups (the cold pool)."""
    from kvd import _native

    refused = {_native.REFUSED_POOL_FULL, _native.SKIPPED}
    per: list[int] = []
    at.belady(events, capacity, per)
    out = {k: 0 for k in ("min_hits", "kvd_hits", "lost", "gained", "lost_refused", "lost_in_flight", "lost_evicted_read",
                          "lost_evicted_unread", "lost_at_head", "lost_lookups", "unanswered", "retrieved_gone",
                          "first_tenth_min_hits", "first_tenth_kvd_hits")}
    first_tenth = len(per) // 10
    last_store: dict[int, tuple[int, int]] = {}
    read_since: set[int] = set()
    li = 0
    for i, (kind, keys) in enumerate(events):
        r = replies.get(i)
        if kind == "store":
            codes = r[0] if r is not None else b"\xff" * len(keys)
            for k, o in zip(keys, codes):
                if o != _native.ALREADY_STORED or k not in last_store:
                    last_store[k] = (i, o)
                    read_since.discard(k)
            continue
        m = per[li]
        li += 1
        out["min_hits"] += m
        if r is None:
            out["unanswered"] += m
            continue
        h = int(r[0])
        out["kvd_hits"] += h
        if li <= first_tenth:
            out["first_tenth_min_hits"] += m
            out["first_tenth_kvd_hits"] += h
        read_since.update(keys[:h])
        if h >= m:
            out["gained"] += h - m
            continue
        lost = m - h
        out["lost"] += lost
        out["lost_lookups"] += 1
        if h == 0:
            out["lost_at_head"] += lost
        c = keys[h]
        j, o = last_store.get(c, (-1, -1))
        if o in refused:
            out["lost_refused"] += lost
        elif j in in_flight.get(i, ()):
            out["lost_in_flight"] += lost
        elif c in read_since:
            out["lost_evicted_read"] += lost
        else:
            out["lost_evicted_unread"] += lost
    for r, keys in retrieves:
        if r is not None:
            out["retrieved_gone"] += sum(1 for o in r[0] if o != _native.LOADED)
    return out


def settle(eng: Engine, tap: Tap) -> None:
    """Exact mode: wait for every store, load and pin release of the step, so that kvd saw the
    events in the order they were sent."""
    for p in tap.lookups + tap.releases + tap.stores:
        p.result(30)
    tap.lookups.clear()
    tap.releases.clear()
    tap.stores.clear()
    deadline = time.monotonic() + 30
    while eng.worker.has_pending():
        eng._collect()  # noqa: SLF001 - the engine's own completion handling
        if time.monotonic() > deadline:
            raise RuntimeError("kvd did not complete the step's copies")
        time.sleep(0.0002)
    eng._collect()  # noqa: SLF001


# --- report ----------------------------------------------------------------------------------


def pct(x: float, y: float) -> str:
    return f"{100 * x / y:.1f}%" if y else "–"


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(args, results: list[Result], geo_name: str, geo, flops_rate: float | None, ceiling_h2d: float | None, unique_chunks: int) -> None:
    layers, heads, content, flops_per_token, what = geo
    real_token_bytes = layers * heads * content * 2
    first = results[0]
    bel = at.belady(first.events, first.capacity_chunks)
    unb = at.unbounded(first.events)
    print(f"\n### {geo_name} ({what}), {args.layout}, token scale {args.token_scale}")
    print(f"\nKV per token {real_token_bytes / 1024:.0f} KiB; page {first.page_bytes / 2**20:.2f} MiB ({256 // args.token_scale} tokens = 256 trace tokens); "
          f"GPU KV {args.gpu_blocks} blocks of {BLOCK} tokens ({args.gpu_blocks * BLOCK * args.token_scale:,} trace tokens); "
          f"kvd pool {first.capacity_chunks} chunks = {pct(first.capacity_chunks, unique_chunks)} of the {unique_chunks} distinct chunks the replay stores. "
          f"Reference caches on the first policy's events: Belady's MIN with {first.capacity_chunks} chunks hits {pct(*bel)}, a pool that never evicts {pct(*unb)}.\n")
    print("| --eviction | turns | prompt tokens | from GPU prefix cache | from kvd | computed | kvd hit rate (chunks) | vs MIN, same events | vs MIN on its own events | kvd's count: hits ÷ MIN's, own events | vs unbounded | preemptions | loads ok/failed | loaded GB | stored GB | load GB/s (busy) | load p50 / p99 ms, ≤32k / >32k trace tokens | refused / skipped stores | evictions | unreachable at end (chunks) | checked GB, mismatches | wall s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        s = r.stats
        own_bel = at.belady(r.events, r.capacity_chunks)
        own_unb = at.unbounded(r.events)
        m = r.metrics
        loaded = m.get('kvd_bytes_retrieved_total', 0.0)
        stored = m.get('kvd_bytes_stored_total', 0.0)
        small = [d * 1e3 for n, d, k in s.loads if n * args.token_scale <= 32768 and k]
        large = [d * 1e3 for n, d, k in s.loads if n * args.token_scale > 32768 and k]
        refused = sum(v for k, v in m.items() if k.startswith("kvd_store_chunks_total") and "refused" in k)
        # kvd_unreachable_chunks is a gauge: its value when the replay ended.
        skipped = sum(v for k, v in m.items() if k.startswith("kvd_store_chunks_total") and "skipped" in k)
        gbs = loaded / s.load_busy_s / 1e9 if s.load_busy_s else float("nan")
        ceil = f" ({gbs / ceiling_h2d:.2f} of {ceiling_h2d:.1f})" if ceiling_h2d else ""
        hr = r.tap_hits / r.tap_asked if r.tap_asked else 0.0
        # kvd's own count covers every lookup it answered, as MIN's does; the tap's counts only
        # the lookups whose answers the connector read (a request asked again, or dropped,
        # leaves one unread), so kvd's is the like-for-like figure.
        kvd_hits = m.get('kvd_lookup_chunks_total{result="hit"}', 0.0)
        kvd_asked = kvd_hits + m.get('kvd_lookup_chunks_total{result="miss"}', 0.0)
        kvd_vs_min = kvd_hits / own_bel[0] if own_bel[0] else float("nan")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({
                    "geometry": geo_name, "policy": r.policy, "traces": args.half or args.traces or f"first {args.users}",
                    "pool_frac": args.pool_frac, "pool_chunks": r.capacity_chunks, "distinct_chunks": unique_chunks,
                    "token_scale": args.token_scale, "gpu_blocks": args.gpu_blocks, "check_layers": args.check_layers,
                    "kvd_hits": kvd_hits, "kvd_asked": kvd_asked, "tap_hits": r.tap_hits, "tap_asked": r.tap_asked,
                    "min_hits": own_bel[0], "min_asked": own_bel[1], "unbounded_hits": own_unb[0],
                    "prompt_tokens": s.prompt_tokens, "kvd_hit_tokens": s.kvd_hit_tokens, "gpu_hit_tokens": s.gpu_hit_tokens,
                    "refused": refused, "skipped": skipped,
                    "refused_by_reason": {k.split('"')[1]: v for k, v in m.items() if k.startswith("kvd_store_refusals_total{")},
                    "unreachable_end": m.get('kvd_unreachable_chunks', 0),
                    "pin_budget_chunks": m.get('kvd_lookup_pin_budget_chunks_total', 0), "evictions": m.get('kvd_evictions_total', 0),
                    "loads_failed": s.load_failures, "mismatches": s.mismatched_bytes, "wall_s": r.wall_s, "loss": r.loss,
                    "steps": s.steps, "padded_steps": s.padded_steps, "padded_s": s.padded_s,
                    "date": time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}) + "\n")
        print(f"| {r.policy} | {r.turns} | {s.prompt_tokens:,} | {pct(s.gpu_hit_tokens, s.prompt_tokens)} | {pct(s.kvd_hit_tokens, s.prompt_tokens)} | "
              f"{pct(s.computed_prompt_tokens, s.prompt_tokens)} | {100 * hr:.1f}% | {r.tap_hits / bel[0]:.3f} | {pct(*own_bel)} → {r.tap_hits / own_bel[0] if own_bel[0] else float('nan'):.3f} | {pct(kvd_hits, kvd_asked)} → {kvd_vs_min:.3f} | "
              f"{r.tap_hits / own_unb[0] if own_unb[0] else float('nan'):.3f} | {s.preemptions} | {len(s.loads) - s.load_failures}/{s.load_failures} | "
              f"{loaded / 1e9:.2f} | {stored / 1e9:.2f} | {gbs:.1f}{ceil} | {percentile(small, .5):.1f} / {percentile(small, .99):.1f}, {percentile(large, .5):.1f} / {percentile(large, .99):.1f} | "
              f"{refused:.0f} / {skipped:.0f} | {m.get('kvd_evictions_total', 0):.0f} | {m.get('kvd_unreachable_chunks', 0):.0f} | {r.checked_bytes / 1e9:.2f}, {s.mismatched_bytes} | {r.wall_s:.1f} |")
    print("\nWhere kvd's hits fall short of MIN's, same events (chunks; `breakdown`): the shortfall of each lookup put on the chunk "
          "where kvd's hit stopped.\n")
    print("| --eviction | MIN hits | kvd hits | lost (lookups) | gained | lost: store refused | lost: store in flight | lost: evicted, read since stored | "
          "lost: evicted, unread | of the lost, at the head | unanswered | retrieves that found a chunk gone (chunks) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        x = r.loss
        print(f"| {r.policy} | {x['min_hits']:,} | {x['kvd_hits']:,} | {x['lost']:,} ({x['lost_lookups']:,}) | {x['gained']:,} | {x['lost_refused']:,} | "
              f"{x['lost_in_flight']:,} | {x['lost_evicted_read']:,} | {x['lost_evicted_unread']:,} | {x['lost_at_head']:,} | {x['unanswered']:,} | "
              f"{x['retrieved_gone']:,} |")
    if args.disk_dir:
        print("\nPer tier (chunks a lookup found beyond the GPU prefix cache; bytes moved):\n")
        print("| --eviction | kvd hit rate (chunks) | from L1 | from disk | disk chunks held at end | L1 → GPU GB | disk → L1 GB | L1 → disk GB | handed to disk: written / present / dropped (busy, unregistered) / failed / not admitted | taken back while written | reserve at end MiB | disk lookup timeouts | rejected |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            m = r.metrics
            disk_hits = m.get('kvd_disk_lookup_chunks_total{result="hit"}', 0.0)
            disk_read = m.get('kvd_disk_bytes_total{direction="read"}', 0.0)
            disk_write = m.get('kvd_disk_bytes_total{direction="write"}', 0.0)
            ev = {o: m.get('kvd_disk_evicted_chunks_total{outcome="%s"}' % o, 0.0)
                  for o in ("written", "present", "dropped_busy", "failed", "dropped_unregistered", "not_admitted")}
            lost = ev["dropped_busy"] + ev["dropped_unregistered"]
            hr = r.tap_hits / r.tap_asked if r.tap_asked else 0.0
            print(f"| {r.policy} | {100 * hr:.1f}% | {pct(r.tap_hits - disk_hits, r.tap_asked)} | {pct(disk_hits, r.tap_asked)} | "
                  f"{m.get('kvd_disk_chunks', 0):.0f} | {m.get('kvd_bytes_retrieved_total', 0) / 1e9:.2f} | "
                  f"{disk_read / 1e9:.2f} | {disk_write / 1e9:.2f} | "
                  f"{ev['written']:.0f} / {ev['present']:.0f} / {lost:.0f} / {ev['failed']:.0f} / {ev['not_admitted']:.0f} | "
                  f"{m.get('kvd_l1_disk_taken_back_total', 0):.0f} | {m.get('kvd_l1_disk_reserve_bytes', 0) / 2**20:.0f} | "
                  f"{m.get('kvd_disk_load_timeouts_total', 0):.0f} | {m.get('kvd_disk_rejected_values_total', 0):.0f} |")
    if flops_rate:
        print(f"\nPrefill compute saved (method: prompt tokens not computed × {flops_per_token / 1e9:.0f} GFLOP per token "
              f"(2 × active parameters; attention over the context not counted, so an underestimate for long contexts) × token scale "
              f"{args.token_scale} ÷ the H200's bf16 rate measured in this run, {flops_rate:.0f} TFLOP/s):\n")
        for r in results:
            s = r.stats
            print(f"- {r.policy}: from kvd {s.kvd_hit_tokens * args.token_scale * flops_per_token / (flops_rate * 1e12):.1f} s of prefill, "
                  f"from the GPU prefix cache {s.gpu_hit_tokens * args.token_scale * flops_per_token / (flops_rate * 1e12):.1f} s")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvd", required=True, help="the kvd binary")
    ap.add_argument("--host", action="store_true", help="host memory instead of a GPU (CI)")
    ap.add_argument("--traces", default="", help="comma list of trace ids (default: the first --users traces)")
    ap.add_argument("--trace-dir", default=os.environ.get("KVD_TRACES", TRACES if os.path.isdir(TRACES) else SMALL_TRACES))
    ap.add_argument("--half", choices=["A", "B"], default=None,
                    help="the traces at odd (A, where policies are chosen) or even (B, where the choice is confirmed) places of the sorted names")
    ap.add_argument("--check-layers", type=int, default=0, help="host mode: write and check only the first N layers' bytes (0: all)")
    ap.add_argument("--json", default="", help="append one JSON line per replay here (the figures of the report's row)")
    ap.add_argument("--users", type=int, default=48, help="traces replayed at once")
    ap.add_argument("--max-turns", type=int, default=0, help="turns per conversation (0: all)")
    ap.add_argument("--geometry", default="llama-3.1-8b,deepseek-mla", help=f"comma list of: {', '.join(GEOMETRIES)}")
    ap.add_argument("--layout", default="BLNHC", help="BLNHC or LBNHC")
    ap.add_argument("--eviction", default="lru,fifo,s3fifo",
                    help="policies to replay with; POLICY@BINARY runs that replay with another kvd binary (before/after in one run)")
    ap.add_argument("--token-scale", type=int, default=16, help="64/scale tokens per 64-token trace block")
    ap.add_argument("--gpu-blocks", type=int, default=16384, help="GPU KV blocks of 16 tokens")
    ap.add_argument("--pool-frac", type=float, default=0.25, help="kvd pool as a fraction of the distinct chunks stored")
    ap.add_argument("--pool-gib", type=float, default=0.0, help="kvd pool in GiB (overrides --pool-frac)")
    ap.add_argument("--slab-mb", type=int, default=0, help="kvd --slab-mb (0: kvd's default)")
    ap.add_argument("--disk-dir", default="", help="also give kvd a disk tier (a file here) holding every distinct chunk")
    ap.add_argument("--token-budget", type=int, default=2048, help="tokens per engine step (chunked prefill)")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--max-decode", type=int, default=8, help="generated tokens per turn at most")
    ap.add_argument("--step-s", type=float, default=2.0, help="trace seconds per engine step")
    ap.add_argument("--step-wall-ms", type=float, default=30.0,
                    help="the real time one engine step stands for: a step that runs nothing (only loads or "
                         "stores in flight) advances the trace clock by its wall time at this rate, not by a "
                         "whole --step-s (0: a whole step, the replay before session 13); a step that runs "
                         "while a request waits on kvd (a lookup asked again, a load in flight) lasts at "
                         "least this long (not with --exact; before session 26 it did not)")
    ap.add_argument("--max-gap-s", type=float, default=120.0, help="longest think time between turns, trace seconds")
    ap.add_argument("--exact", action="store_true", help="wait for each step's copies (for exact reference checks)")
    ap.add_argument("--kvd-log", default=None)
    ap.add_argument("--kvd-arg", action="append", default=[], help="an extra argument for kvd serve (repeatable), e.g. --kvd-arg=--lookup-pin-pct=100")
    ap.add_argument("--quiet", action="store_true", help="print no report")
    ap.add_argument("--dump-events", default="", help="write what kvd was sent to PATH.POLICY.txt (dump_events), for offline replays")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, list[Result]]:
    """Replays per geometry and policy; prints the report unless ``--quiet``."""

    files = at.trace_files(args.trace_dir)
    if args.traces:
        want = args.traces.split(",")
        files = [f for f in files if os.path.basename(f).split(".")[0] in want]
    elif args.half:
        # A fixed split, documented in benches/RESULTS.md: sorted names, 1-based odd places = A.
        files = files[0 if args.half == "A" else 1::2]
    else:
        files = files[:args.users]
    convs = [c for f in files for c in at.load(f, args.max_turns or None)]
    tokens = at.Tokens(args.token_scale)
    chunk = 256 // args.token_scale
    # Distinct chunks the replay stores (every full prompt chunk of every turn), for the pool size.
    distinct: set[int] = set()
    for c in convs:
        for t in c.turns:
            _, seeds = tokens.prompt(c.trace, t)
            distinct.update(seeds[chunk - 1::chunk].tolist())
    say = (lambda *a, **k: None) if args.quiet else print
    say(f"# {len(files)} traces, {len(convs)} conversations, {sum(len(c.turns) for c in convs)} turns, "
          f"{sum(t.tokens_in for c in convs for t in c.turns):,} trace prompt tokens, {len(distinct)} distinct chunks; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    flops_rate = ceiling_h2d = None
    if not args.host:
        import torch

        from dataplane import ceilings, matmul_tflops

        torch.cuda.init()
        print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
        ceiling_h2d = ceilings()["h2d"]
        flops_rate = matmul_tflops(3.0)[1]
        torch.cuda.empty_cache()
        print(f"# h2d ceiling {ceiling_h2d:.1f} GB/s (contiguous 4 GiB pinned copy); bf16 matmul {flops_rate:.0f} TFLOP/s")
    out: dict[str, list[Result]] = {}
    for name in args.geometry.split(","):
        geo = GEOMETRIES[name]
        page = 256 // args.token_scale * geo[0] * geo[1] * geo[2] * 2
        pool_gib = args.pool_gib or max(0.002, len(distinct) * args.pool_frac * page / (1 << 30))
        # Every distinct chunk fits on disk: a value is its page and a 40-byte header in whole
        # 4 KiB blocks; a quarter more for the log's slack.
        args.disk_gib = 1.25 * len(distinct) * (-(-(page + 40) // 4096) * 4096) / (1 << 30) + 0.01
        results = []
        for policy in args.eviction.split(","):
            r = replay(args, convs, tokens, policy, geo, pool_gib)
            results.append(r)
            say(f"# {name} {policy}: {r.turns} turns in {r.wall_s:.1f} s, {r.stats.steps} steps, "
                f"{r.stats.padded_steps} of them padded to --step-wall-ms while a request waited on kvd "
                f"({r.stats.padded_s:.1f} s)", flush=True)
        out[name] = results
        if not args.quiet:
            report(args, results, name, geo, flops_rate, ceiling_h2d, len(distinct))
    return out


def main(argv: list[str] | None = None) -> int:
    out = run(parse(argv))
    failures = sum(r.stats.mismatched_bytes for rs in out.values() for r in rs)
    if failures:
        print(f"FAILED: {failures} loaded bytes differ from what was stored")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
