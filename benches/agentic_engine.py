"""A model of vLLM 0.33's engine core, enough to drive the kvd connector as vLLM drives it.

What is modelled, after vLLM's v1 ``Scheduler`` and ``KVCacheManager``:
- a fixed number of GPU KV blocks and vLLM's prefix cache over them: full blocks are keyed by
  their prefix; a finished request's blocks go to the free queue's tail in reverse order (its
  last block is reused first) and stay hits until allocation takes them;
- a scheduling step: running requests first (the rest of a prefill, or one decode token), then
  waiting ones, under a token budget (chunked prefill); a request that cannot get blocks
  preempts the newest running request, which frees its blocks and starts over;
- the connector as vLLM calls it: ``get_num_new_matched_tokens`` for a request with nothing
  computed (new or preempted), ``None`` meaning "ask again", an asynchronous load parking the
  request until the worker reports it received; ``update_state_after_alloc``; the step's plan
  from ``build``; ``request_finished`` delaying the block frees until the stores are done; load
  errors turning into recomputation from the first failed block.

The "forward pass" writes each scheduled token's KV from its seed (``KvMemory``); no model runs.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from kvd.metadata import KvdMetadata
from kvd.scheduler import KvdScheduler, SchedRequest
from kvd.worker import KvdWorker

WAITING, WAITING_FOR_REMOTE_KVS, RUNNING, FINISHED = "waiting", "remote", "running", "finished"


class KvMemory(Protocol):
    """The GPU (or host) KV cache: writes and checks tokens' KV by seed."""

    def write(self, blocks: np.ndarray, offsets: np.ndarray, seeds: np.ndarray) -> None: ...

    def check(self, blocks: np.ndarray, offsets: np.ndarray, seeds: np.ndarray) -> int: ...


@dataclass
class Request:
    req_id: str
    tokens: list[int]
    seeds: np.ndarray
    num_prompt: int
    max_out: int
    arrival_step: int
    on_finish: Callable[["Request"], None] = lambda r: None
    status: str = WAITING
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    out: int = 0
    #: Tokens of the load in flight.
    load_tokens: int = 0
    load_started: float = 0.0
    preemptions: int = 0
    sched: SchedRequest | None = None

    def block_key(self, i: int, block_tokens: int) -> int:
        """Prefix-cache key of the request's i-th full block: the seed of its last token."""
        return int(self.seeds[(i + 1) * block_tokens - 1])


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0
    gpu_hit_tokens: int = 0
    kvd_hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    preemptions: int = 0
    load_failures: int = 0
    failed_block_tokens: int = 0
    checked_bytes: int = 0
    checked_tokens: int = 0
    mismatched_bytes: int = 0
    #: (prompt tokens, load seconds, loaded tokens) of each completed load.
    loads: list[tuple[int, float, int]] = field(default_factory=list)
    load_busy_s: float = 0.0
    #: Steps that ran while a request waited on kvd, and their wall seconds (the replay pads
    #: each to ``--step-wall-ms``).
    padded_steps: int = 0
    padded_s: float = 0.0


class BlockPool:
    """GPU KV blocks with vLLM's prefix cache: a free queue (oldest first) whose blocks keep
    their key until allocation takes them."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[int | None] = [None] * num_blocks
        # Block 0 is vLLM's null block: never handed to a request.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[int, int] = {}

    def hits(self, req: Request, block_tokens: int, max_tokens: int) -> list[int]:
        """Blocks of the longest cached prefix, at most ``max_tokens`` tokens."""
        out = []
        for i in range(max_tokens // block_tokens):
            b = self.cached.get(req.block_key(i, block_tokens))
            if b is None:
                break
            out.append(b)
        return out

    def can_take(self, hit_blocks: list[int], new: int) -> bool:
        return len(self.free) - sum(1 for b in hit_blocks if self.ref[b] == 0) >= new

    def take(self, hit_blocks: list[int], new: int) -> list[int]:
        """The hit blocks (now referenced) followed by ``new`` blocks from the free queue's head."""
        for b in hit_blocks:
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
        out = list(hit_blocks)
        for _ in range(new):
            b, _ = self.free.popitem(last=False)
            k = self.key[b]
            if k is not None:
                if self.cached.get(k) == b:
                    del self.cached[k]
                self.key[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def cache(self, b: int, key: int) -> None:
        if self.key[b] is None and key not in self.cached:
            self.key[b] = key
            self.cached[key] = b


class Engine:
    """One vLLM engine (one rank) driving a KvdScheduler and a KvdWorker."""

    def __init__(self, sched: KvdScheduler, worker: KvdWorker, memory: KvMemory, *, num_blocks: int, block_tokens: int,
                 token_budget: int, max_seqs: int, check: bool = True) -> None:
        self.sched, self.worker, self.mem = sched, worker, memory
        self.pool = BlockPool(num_blocks)
        self.block_tokens = block_tokens
        self.budget = token_budget
        self.max_seqs = max_seqs
        self.check = check
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}
        self.delayed: dict[str, Request] = {}
        self.stats = EngineStats()
        self._recved: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._finished_now: list[Request] = []
        self._loading_since: float | None = None
        #: Whether, after the last step, a request waits on kvd: a lookup it asked again, or a
        #: load in flight.
        self.held = False

    # --- admission ------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if -(-(len(req.tokens) + req.max_out) // self.block_tokens) > self.pool.num_blocks:
            raise ValueError(f"{req.req_id}: {len(req.tokens)} tokens do not fit {self.pool.num_blocks} KV blocks (vLLM would refuse it)")
        req.sched = SchedRequest(req_id=req.req_id, token_ids=req.tokens, num_prompt_tokens=req.num_prompt)
        self.stats.prompt_tokens += req.num_prompt
        self.waiting.append(req)

    def idle(self) -> bool:
        return not (self.waiting or self.running or self.remote or self.delayed)

    def _blocks_for(self, req: Request, tokens: int) -> int:
        return max(0, -(-tokens // self.block_tokens) - len(req.blocks))

    def _preempt(self) -> Request | None:
        if not self.running:
            return None
        victim = self.running.pop()
        self.pool.release(victim.blocks)
        victim.blocks, victim.computed, victim.status = [], 0, WAITING
        victim.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _unstall(self) -> None:
        """Nothing runs and every waiting request that holds blocks (its load done) needs more
        than are free: preempt the newest of them, as vLLM would preempt a running request."""
        holders = [r for r in self.waiting if r.blocks and r.status == WAITING]
        if not holders or any(self.pool.can_take([], self._blocks_for(r, len(r.tokens))) for r in holders):
            return
        victim = holders[-1]
        self.pool.release(victim.blocks)
        victim.blocks, victim.computed = [], 0
        victim.preemptions += 1
        self.stats.preemptions += 1

    # --- one step -------------------------------------------------------------------------

    def step(self) -> bool:
        """Schedule, run the connector's worker side and the "forward pass", then collect what
        finished. Whether any token was scheduled (else the step only polled for loads and
        stores in flight)."""
        self.stats.steps += 1
        self.held = False
        budget = self.budget
        scheduled: list[tuple[Request, int, int]] = []
        preempted: list[str] = []
        # Running requests first, oldest first.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.tokens) - req.computed, budget)
            while not self.pool.can_take([], self._blocks_for(req, req.computed + n)):
                victim = self._preempt()
                if victim is None:
                    break
                preempted.append(victim.req_id)
                if victim is req:
                    break
            if req.status != RUNNING:
                break
            if not self.pool.can_take([], self._blocks_for(req, req.computed + n)):
                break
            req.blocks += self.pool.take([], self._blocks_for(req, req.computed + n))
            scheduled.append((req, req.computed, n))
            budget -= n
            i += 1
        # Then waiting ones, unless a preemption showed that blocks ran out.
        skipped: list[Request] = []
        blocked = False
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_seqs:
            req = self.waiting.popleft()
            # Once a request could not get blocks, only requests that already hold theirs (their
            # load is done) go on: they free blocks by finishing. (vLLM stops at the first; with
            # loads parked in the queue that can stall a small GPU for good.)
            if req.status == WAITING_FOR_REMOTE_KVS or (blocked and not req.blocks):
                skipped.append(req)
                continue
            hit_blocks: list[int] = []
            ext, is_async = 0, False
            # Only a request holding no blocks (new, or preempted) asks vLLM's prefix cache and
            # the connector; one whose load failed keeps its blocks and computes the rest.
            if not req.blocks:
                hit_blocks = self.pool.hits(req, self.block_tokens, len(req.tokens) - 1)
                gpu = len(hit_blocks) * self.block_tokens
                ext_, is_async = self.sched.get_num_new_matched_tokens(req.sched, gpu)
                if ext_ is None:
                    self.held = True
                    skipped.append(req)
                    continue
                ext = ext_
            base = req.computed if req.blocks else len(hit_blocks) * self.block_tokens
            gpu_hit = 0 if req.blocks else base
            if is_async and ext > 0:
                need = self._blocks_for(req, base + ext) - len(hit_blocks)
                if not self.pool.can_take(hit_blocks, need):
                    blocked = True
                    skipped.append(req)
                    continue
                req.blocks = req.blocks + self.pool.take(hit_blocks, need)
                assert len(req.blocks) * self.block_tokens >= base + ext, (req.req_id, len(req.blocks), base, ext, need, len(hit_blocks))
                self.stats.gpu_hit_tokens += gpu_hit
                self.sched.update_state_after_alloc(req.req_id, [list(req.blocks)], ext)
                req.computed = base
                req.load_tokens = ext
                req.status = WAITING_FOR_REMOTE_KVS
                self.remote[req.req_id] = req
                skipped.append(req)
                continue
            n = min(len(req.tokens) - base, budget)
            need = self._blocks_for(req, base + n) - len(hit_blocks)
            if not self.pool.can_take(hit_blocks, need):
                blocked = True
                skipped.append(req)
                continue
            req.blocks = req.blocks + self.pool.take(hit_blocks, need)
            self.stats.gpu_hit_tokens += gpu_hit
            self.sched.update_state_after_alloc(req.req_id, [list(req.blocks)], 0)
            req.computed = base
            req.status = RUNNING
            self.running.append(req)
            scheduled.append((req, base, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        if not scheduled and not self.running and not self.remote:
            self._unstall()

        meta = self.sched.build([(r.sched, c, n, [list(r.blocks)]) for r, c, n in scheduled], preempted)
        self._worker_step(meta, scheduled)
        self.held = self.held or bool(self.remote)
        return bool(scheduled)

    def _worker_step(self, meta: KvdMetadata, scheduled: list[tuple[Request, int, int]]) -> None:
        w = self.worker
        w.handle_preemptions(meta)
        now = time.perf_counter()
        for op in meta.loads:
            self.remote[op.req_id].load_started = now
        w.start_load(meta)
        # The forward pass: the KV of every scheduled token, written from its seed.
        if scheduled:
            blocks, offsets, seeds = [], [], []
            for req, c, n in scheduled:
                pos = np.arange(c, c + n)
                blocks.append(np.asarray(req.blocks, dtype=np.int64)[pos // self.block_tokens])
                offsets.append(pos % self.block_tokens)
                seeds.append(req.seeds[c:c + n])
                if c < req.num_prompt:
                    self.stats.computed_prompt_tokens += min(c + n, req.num_prompt) - c
            self.mem.write(np.concatenate(blocks), np.concatenate(offsets), np.concatenate(seeds))
        w.save(meta)
        for req, c, n in scheduled:
            req.computed = c + n
            full = req.computed // self.block_tokens
            for i in range(c // self.block_tokens, full):
                self.pool.cache(req.blocks[i], req.block_key(i, self.block_tokens))
            if req.computed == len(req.tokens):
                req.out += 1
                if req.out >= req.max_out:
                    self._finish(req)
                else:
                    req.tokens.append(int(req.seeds[len(req.tokens)]) % 128_000)
        self._collect()

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        req.status = FINISHED
        if self.sched.request_finished(req.req_id):
            self.delayed[req.req_id] = req
        else:
            self.pool.release(req.blocks)
        req.on_finish(req)

    def _collect(self) -> None:
        sending, recving = self.worker.get_finished()
        for rid in sending:
            req = self.delayed.pop(rid, None)
            if req is not None:
                self.pool.release(req.blocks)
        errors = self.worker.load_errors()
        failed = self.worker.failed_loads()
        now = time.perf_counter()
        for rid in recving:
            req = self.remote.pop(rid)
            self._loaded(req, errors, rid in failed, now)
        if self.remote and self._loading_since is None:
            self._loading_since = now
        elif not self.remote and self._loading_since is not None:
            self.stats.load_busy_s += now - self._loading_since
            self._loading_since = None

    def _loaded(self, req: Request, errors: set[int], failed: bool, now: float) -> None:
        bt = self.block_tokens
        start, end = req.computed, req.computed + req.load_tokens
        good_end = end
        if failed:
            self.stats.load_failures += 1
            bad = [i for i in range(start // bt, -(-end // bt)) if req.blocks[i] in errors]
            # No block named: the whole load is suspect.
            good_end = max(start, bad[0] * bt) if bad else start
        if self.check and good_end > start:
            pos = np.arange(start, good_end)
            blocks = np.asarray(req.blocks, dtype=np.int64)[pos // bt]
            bad_bytes = self.mem.check(blocks, pos % bt, req.seeds[start:good_end])
            self.stats.checked_tokens += good_end - start
            self.stats.mismatched_bytes += bad_bytes
        self.stats.failed_block_tokens += end - good_end
        self.stats.kvd_hit_tokens += good_end - start
        self.stats.loads.append((req.num_prompt, now - req.load_started, good_end - start))
        req.computed = good_end
        for i in range(start // bt, good_end // bt):
            self.pool.cache(req.blocks[i], req.block_key(i, bt))
        req.status = WAITING
