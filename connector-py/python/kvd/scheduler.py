"""The scheduler side of the connector, independent of vLLM: it decides, per request, how many
prompt tokens kvd can supply (asynchronously — vLLM's scheduling loop never waits), which blocks
to load them into, and which freshly computed chunks to store.

Lookups run in the background: the first call for a request starts them and answers "ask again"
(``None``); a later call answers with the hit beyond vLLM's own prefix cache, to be loaded
asynchronously. Hit chunks are pinned in kvd until the workers have read them.
"""

from __future__ import annotations

import array
import logging
import time
from dataclasses import dataclass, field
from typing import Collection, Iterable, Sequence

from kvd import _native
from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.groups import chunk_mismatch, state_chunk_advice, window_blocks, window_entry
from kvd.keys import ChunkHasher, Span
from kvd.keys import fingerprint as key_fingerprint
from kvd.metadata import SKIP, Chunk, KvdMetadata, LoadOp, StoreOp

log = logging.getLogger("kvd")


@dataclass(frozen=True)
class GroupInfo:
    """One KV-cache group as the scheduler sees it."""

    #: Model and layout fingerprint of this group.
    fingerprint: int
    #: Tokens per block of this group.
    block_tokens: int
    #: Shards a chunk must be stored on to count: every TP rank, or [0] when every rank holds
    #: the same KV (MLA).
    shards: tuple[int, ...]
    #: Ranks that read each shard of a hit: 1, or the TP size for MLA.
    readers: int = 1
    #: Sliding-window group: vLLM keeps only the window's blocks (the rest of its block table
    #: is the null block), and frees blocks leaving the window while the request runs.
    sliding: bool = False
    #: A sliding group's window in tokens. A hit of n chunks needs only the blocks of the
    #: window before chunk n's end, and a chunk is stored from whatever blocks vLLM still
    #: holds (``kvd.groups.window_entry`` says what an entry holds). None for R-SWA, whose
    #: freed blocks are not a window's: there a hit needs every chunk, and only chunks
    #: computed wholly in the step are stored.
    window: int | None = None
    #: A group kvd neither stores nor loads (see ``kvd.groups.GroupFacts.kind``).
    ignored: bool = False
    #: A state group (Mamba): a chunk is the one block holding the state after the chunk's last
    #: token, stored when a step ends on that boundary; a hit of n chunks needs only chunk n-1's.
    state: bool = False


@dataclass
class SchedRequest:
    """What the scheduler side needs of a vLLM request."""

    req_id: str
    #: Every token known so far (prompt, then generated).
    token_ids: Sequence[int]
    num_prompt_tokens: int
    #: Hash of the request's cache_salt (0 for none).
    salt: int = 0
    #: Multimodal inputs over token spans.
    spans: Sequence[Span] = ()
    #: What else changes the KV of the same tokens (a LoRA adapter).
    namespace: object = None
    #: False for requests whose KV cannot be keyed by tokens (prompt embeddings).
    cacheable: bool = True


#: Seconds after which the workers' last "cannot load" is stale: vLLM's scheduler hears from them
#: right after every step, so a word older than this means the engine was idle since.
READY_STALE_S = 0.2

#: The scheduler's counters vLLM's metrics carry (``KvdScheduler.lookup_totals``).
LOOKUP_COUNTERS = ("lookups", "lookups_unwaited", "lookup_waits", "lookup_timeouts")

#: The largest prompt remembered (``KvdScheduler.remember``), in bytes of token ids: a
#: ``Recall`` of it must fit the 64 MiB reply frame the client takes (4M tokens would).
MAX_REMEMBER_BYTES = 16 << 20

#: vLLM's null block: block-table entries of tokens a group does not keep (outside a sliding
#: window). It is never stored from and never loaded into.
NULL_BLOCK = 0


def sub_fingerprint(fingerprint: int, sub: int, subs: int) -> int:
    """The fingerprint a group's ``sub``-th registration is keyed by. A group whose layers all
    share one shape is one registration under the group's fingerprint; a group of layers of
    ``subs`` shapes (DeepSeek-V4: indexer and compressed layers in one group) is ``subs``."""
    return fingerprint if subs == 1 else key_fingerprint("sub-registration", fingerprint, sub)


@dataclass
class _State:
    hasher: ChunkHasher
    lookups: list[_native.Pending[tuple[int, int]]] | None = None
    lookup_at: float = 0.0
    lookup_for: int = -1
    answer: tuple[int | None, bool] | None = None
    hit_chunks: int = 0
    pins: list[int] = field(default_factory=list)
    #: Token range [start, end) to load, once vLLM accepted the hit.
    load: tuple[int, int] | None = None
    block_ids: list[list[int]] = field(default_factory=list)
    stored_chunks: int = 0
    stores_emitted: bool = False
    salt: int = 0
    #: Steps the request was scheduled in (state groups store a local hit's state in the first).
    steps: int = 0
    #: Chunks whose state this request stored or loaded (state groups).
    states: set[int] = field(default_factory=set)
    #: Chunks the lookup asked for.
    asked: int = 0
    #: The tokens of the load vLLM admitted last, [start, end), and whether it was synchronous
    #: (vLLM then recomputes a failure in the running request, asking no lookup).
    loading: tuple[int, int] | None = None
    loading_sync: bool = False
    #: The scheduling pass that gave ``answer`` (a replay in a later pass decides again whether
    #: the hit loads synchronously, against that pass's budget).
    answer_pass: int = -1
    #: A load of this request failed from this token on: vLLM recomputes that part, and the
    #: request's next lookup asks only for the chunks before it, once (a failure that would
    #: recur must not loop the request between lookup and failed load, vllm-project/vllm#55297;
    #: a later lookup, after a preemption, asks for everything again).
    failed_from: int | None = None
    #: The lookup pinned nothing: it was asked while an earlier request's lookup was still
    #: under way in the same scheduling pass. Its answer serves that pass only.
    peek: bool = False
    #: The request waited a step for the workers' word on whether they can load.
    ready_asked: bool = False


def _say_presence(client: _native.Client) -> None:
    """Logs, on each connection, whether lookups that cannot hit skip waiting for kvd."""
    if client.presence_error:
        log.warning("kvd: cannot read kvd's presence filter here (%s): every lookup waits for kvd's reply "
                    "(run vLLM where it shares /dev/shm with kvd, e.g. docker --ipc=host, Kubernetes hostIPC)",
                    client.presence_error)
    elif client.presence:
        log.info("kvd: reading kvd's presence filter %s: lookups kvd cannot serve skip waiting for it", client.presence)


class KvdScheduler:
    """Scheduler-side logic of the kvd connector."""

    def __init__(self, config: KvdConfig, groups: Sequence[GroupInfo], conn: Connection | None) -> None:
        if not groups:
            raise ValueError("the kvd connector needs at least one KV-cache group")
        self.config = config
        self.groups = list(groups)
        self.conn = conn
        self._reqs: dict[str, _State] = {}
        #: Registrations per group, as the workers report them (one until they say otherwise).
        self.subs: list[int] = [1] * len(self.groups)
        self._checked_chunk = 0
        self._mismatch: str | None = None
        self._loads: list[LoadOp] = []
        self._delayed: list[str] = []
        #: Lookups abandoned after lookup_timeout_s; their pins are released when they land.
        self._late: list[_native.Pending[tuple[int, int]]] = []
        self._chunk_tokens = config.chunk_tokens
        #: Since start: lookups sent, of them those answered from kvd's presence filter without
        #: waiting for kvd, answers "ask again" (the request waits a step), lookups
        #: kvd did not answer within ``lookup_timeout_s`` (the request ran as a miss), tokens
        #: hit, chunks planned for storing, prompts kvd remembered (``kvd.warm_group``), loads
        #: started beside the running forward pass (``KvdConfig.load_overlap``).
        self.stats = {"lookups": 0, "lookups_unwaited": 0, "lookup_waits": 0, "lookup_timeouts": 0, "hit_tokens": 0,
                      "stored_chunks": 0, "remembered": 0, "loads_overlapped": 0}
        #: A lookup answered "ask again" in this scheduling pass (until the next ``build``).
        self._pass_waits = False
        #: Scheduling passes so far (one a ``build``), and the tokens this pass loads
        #: synchronously (``KvdConfig.sync_load_tokens``).
        self._pass = 0
        self._sync_tokens = 0
        #: Remembers in flight (``remember``), and whether a refusal was logged.
        self._remembering: list[_native.Pending[int]] = []
        self._remember_warned = False
        #: The workers' last word on whether they can load (``set_workers_ready``), and when it came.
        self.workers_ready = True
        self._ready_report_at = 0.0
        #: Which loads may start beside the forward pass still on the GPU (``KvdConfig.load_overlap``):
        #: only in a model whose blocks leave a request only when it ends (full attention, MLA;
        #: a sliding window or a state group frees blocks of running requests). The blocks vLLM
        #: freed since the last ``build`` and in the pass before it, and the last pass that
        #: preempted a request: under asynchronous scheduling one forward pass runs while the
        #: next step is planned, and it may still use a block freed between the two (a request
        #: that ended in the step before was already planned into it). A load into such a block
        #: waits for the model's stream; two passes instead of one are the margin. vLLM (0.26,
        #: 0.33) already defers freeing such blocks for a loading connector
        #: (``Scheduler.defer_block_free``); this is the second line.
        self.overlap_loads = config.load_overlap and all(
            not (g.sliding or g.state or g.ignored) for g in self.groups)
        self._freed: tuple[set[int], set[int]] = (set(), set())
        self._preempted_pass = -2
        #: Hits load in the step that computes the rest of the request (``KvdConfig.load_mode``).
        kinds = sum(not g.ignored for g in self.groups)
        self.sync_loads = config.load_mode == "sync" or (config.load_mode == "auto" and kinds == 1)
        if conn is not None and config.presence:
            conn.on_connect(_say_presence)
        if self.sync_loads and kinds > 1:
            log.warning("kvd: kvd.load_mode \"sync\" needs a model of one KV cache group (vLLM cannot be told "
                        "which blocks of a running request of %d groups failed to load); loading asynchronously", kinds)
            self.sync_loads = False

    def lookup_totals(self) -> dict[str, int]:
        """``LOOKUP_COUNTERS`` since this scheduler started: what vLLM's metrics show (the
        connector's stats, ``kvd.vllm_stats``)."""
        return {k: self.stats[k] for k in LOOKUP_COUNTERS}

    @property
    def chunk_tokens(self) -> int:
        """kvd's chunk size; while kvd is away, the last one it said (the configured size before
        it ever answered), so that requests keep their state across a reconnection."""
        client = self.conn.client() if self.conn else None
        if client is not None:
            self._chunk_tokens = int(client.server["chunk_tokens"])
        return self._chunk_tokens

    def _state(self, req: SchedRequest) -> _State:
        st = self._reqs.get(req.req_id)
        if st is None or st.hasher.chunk_tokens != self.chunk_tokens:
            st = _State(hasher=ChunkHasher(self.chunk_tokens, req.spans, req.namespace))
            self._reqs[req.req_id] = st
        return st

    def set_workers_ready(self, ready: bool) -> None:
        """Whether every worker can load (``KvdWorker.ready``, reported each step through vLLM's
        worker metadata). While one cannot (its connection is down, or kvd has not taken its
        registration back yet after a restart), lookups answer no hit: a hit's load would fail
        and vLLM recompute it a step later."""
        self._ready_report_at = time.monotonic()
        if ready != self.workers_ready:
            if ready:
                log.info("kvd: every worker is registered with kvd again; lookups resume")
            else:
                log.warning("kvd: a worker is not registered with kvd (reconnecting, or kvd is still starting); "
                            "requests run without kvd's hits until it is")
            self.workers_ready = ready

    def set_subs(self, subs: Sequence[int]) -> None:
        """The workers' registrations per group (``KvdWorker.subs``), reported through vLLM's
        worker metadata; lookups ask for every registration of every group."""
        subs = list(subs)
        if len(subs) == len(self.groups) and subs != self.subs:
            log.info("kvd: the workers registered %s registration(s) per KV cache group", subs)
            self.subs = subs

    def _usable(self) -> bool:
        """False (said once per chunk size) when kvd's chunk is not whole blocks of every group."""
        chunk = self.chunk_tokens
        if chunk != self._checked_chunk:
            self._checked_chunk = chunk
            self._mismatch = chunk_mismatch([g.block_tokens for g in self.groups], chunk)
            if self._mismatch is not None:
                log.error("kvd: offloading is off for this model, vLLM serves without it: %s", self._mismatch)
            advice = state_chunk_advice([(i, g.block_tokens) for i, g in enumerate(self.groups) if g.state], chunk)
            if self._mismatch is None and advice is not None:
                log.warning("kvd: %s", advice)
        return self._mismatch is None

    def _keys(self) -> list[tuple[GroupInfo, int]]:
        """(group, fingerprint) of every registration a hit must be found in."""
        return [
            (g, sub_fingerprint(g.fingerprint, k, n))
            for g, n in zip(self.groups, self.subs)
            if not g.ignored
            for k in range(n)
        ]

    # --- what a group's chunk entry holds ---------------------------------------------------

    def _tail(self, info: GroupInfo) -> int | None:
        """Blocks of a sliding group's chunk entry when it is the chunk's tail (the window fits in
        a chunk): chunk ``c``'s entry is then the ``k`` blocks before its end. None when entries
        are whole chunks."""
        if info.window is None:
            return None
        return window_entry(info.window, info.block_tokens, self.chunk_tokens)

    def _window_start(self, info: GroupInfo, n: int) -> int:
        """The first chunk a hit of ``n`` chunks reads in this group: 0, except in a sliding
        group, which reads only the chunks holding the window before chunk ``n``'s end."""
        if info.window is None:
            return 0
        if self._tail(info) is not None:
            return n - 1
        per = self.chunk_tokens // info.block_tokens
        return max(0, n * per - window_blocks(info.window, info.block_tokens)) // per

    def _kind(self, info: GroupInfo) -> str:
        """How a hit is found in the group: "prefix" (every chunk from the first: kvd's lookup
        answers the prefix it holds), "last" (one entry, the hit's last chunk: kvd's
        ``LookupLast`` answers the latest it holds) or "window" (the chunks a sliding window
        overlaps: a prefix lookup first, then the window's chunks alone, see ``_resolve_hit``)."""
        if info.state or self._tail(info) is not None:
            return "last"
        return "window" if info.window is not None else "prefix"

    def _held(self, info: GroupInfo, held: int) -> int:
        """What a lookup of group ``info`` tells kvd vLLM holds: the ``held`` leading chunks its
        prefix cache covers, which no load reads, so kvd neither pins them nor reads them back
        from its disk (one on its disk still counts towards the hit). Only for a "prefix"
        group: a window group's hit is resolved from chunk 0 (``_resolve_hit``) and a "last"
        lookup names one chunk."""
        return held if self._kind(info) == "prefix" else 0

    def _release(self, pins: list[int]) -> None:
        client = self.conn.client() if self.conn else None
        for p in pins:
            if p and client is not None:
                client.release(p)

    # --- get_num_new_matched_tokens -------------------------------------------------------

    def get_num_new_matched_tokens(self, req: SchedRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvd can load beyond the ``num_computed_tokens`` vLLM found itself, and whether
        the load is asynchronous; ``(None, False)`` means "ask again next step"."""
        if not self.config.load or not req.cacheable or not self._usable():
            return 0, False
        st = self._state(req)
        if not self.workers_ready:
            if not st.ready_asked and time.monotonic() - self._ready_report_at > READY_STALE_S:
                # The engine was idle since the workers said they could not load (vLLM steps
                # only with work): one step brings their word as it is now.
                st.ready_asked = True
                return None, False
            self._drop_lookup(req.req_id)
            return 0, False
        st.salt = req.salt
        if st.peek and not self._pass_waits and st.lookups is not None and all(p.done() for p in st.lookups):
            # An unpinned answer from an earlier pass: ask again, pinned.
            self._release(st.pins)
            st.pins, st.lookups, st.answer, st.load, st.peek = [], None, None, None, False
        if st.answer is not None and st.lookup_for == num_computed_tokens:
            if st.answer[0] and st.answer_pass != self._pass:
                st.answer, st.answer_pass = (st.answer[0], not self._load_sync(st.answer[0])), self._pass
            return st.answer
        conn = self.conn
        client = conn.client() if conn is not None else None
        if conn is None or client is None:
            return 0, False
        chunk = self.chunk_tokens
        # At least one token must be left for vLLM to compute.
        max_chunks = (len(req.token_ids) - 1) // chunk
        if st.failed_from is not None:
            max_chunks = min(max_chunks, st.failed_from // chunk)
        if max_chunks * chunk <= num_computed_tokens:
            return 0, False
        if st.lookups is None or st.lookup_for != num_computed_tokens:
            self._release(st.pins)
            st.pins = []
            # An answer for another num_computed_tokens must not be replayed for this one.
            st.answer, st.load = None, None
            hashes = st.hasher.hashes(req.token_ids, max_chunks)
            st.asked = max_chunks
            # vLLM goes on to the next waiting request when one answers "ask again" (it stops
            # only when blocks run out): while a lookup waits for kvd's disk, every request
            # behind it is looked up, and pinning all of them would give the pool to requests
            # that may wait long. Those lookups pin nothing; a later pass asks again, pinned.
            pinned = not self._pass_waits
            # The chunks vLLM's own prefix cache covers in full: loaded from nowhere.
            held = num_computed_tokens // chunk
            absent = self._absent_from(client, req.salt, hashes, held)
            if absent is not None:
                # kvd certainly lacks a chunk vLLM needs: nothing to load, and no reply to wait
                # for. The lookup still goes (unpinned, sent by the client's threads, its reply
                # unread): kvd learns the parent of the chunk the next store begins with and
                # that what it holds of the prompt was read, as with any lookup.
                for g, fp in self._keys():
                    client.lookup_unread(fp, req.salt, list(g.shards), hashes, readers=g.readers,
                                         last=self._kind(g) == "last", held=self._held(g, held))
                st.lookups, st.peek, st.lookup_for = None, False, num_computed_tokens
                # The stores' start is left where it is: the filter bounds kvd's chunks from
                # above only (a false "may hold", a store still being written, another shard
                # or a window's chunk gone), and a store that began at its bound could leave a
                # chunk kvd lacks out for good. kvd answers "already stored" for what it holds.
                st.answer = (0, False)
                self.stats["lookups"] += 1
                self.stats["lookups_unwaited"] += 1
                return st.answer
            st.peek = not pinned
            try:
                st.lookups = [
                    client.lookup(fp, req.salt, list(g.shards), hashes, pin=pinned, readers=g.readers,
                                  last=self._kind(g) == "last", held=self._held(g, held))
                    for g, fp in self._keys()
                ]
            except _native.KvdError as e:
                conn.lost(e)
                return 0, False
            st.lookup_at = time.monotonic()
            st.lookup_for = num_computed_tokens
            self.stats["lookups"] += 1
        if not all(p.done() for p in st.lookups):
            self._wait(st.lookups, st.lookup_at + self.config.lookup_wait_s)
        if not all(p.done() for p in st.lookups):
            if time.monotonic() - st.lookup_at < self.config.lookup_timeout_s:
                self._pass_waits = True
                self.stats["lookup_waits"] += 1
                return None, False
            # Too slow: proceed without kvd; pins that arrive later are released.
            self.stats["lookup_timeouts"] += 1
            self._late.extend(st.lookups)
            st.answer = (0, False)
            return st.answer
        hits, pins = [], []
        try:
            for p in st.lookups:
                hit, pin = p.result()
                hits.append(hit)
                pins.append(pin)
        except _native.ConnectionLost as e:
            conn.lost(e)
            st.answer = (0, False)
            return st.answer
        except _native.KvdError as e:
            log.warning("kvd: lookup for %s failed: %s", req.req_id, e)
            st.answer = (0, False)
            return st.answer
        st.pins = pins
        keys = self._keys()
        kinds = [self._kind(g) for g, _ in keys]
        prefix = [h for k, h in zip(kinds, hits) if k == "prefix"]
        st.hit_chunks = min(prefix) if prefix else st.asked
        if len(prefix) < len(keys):
            st.hit_chunks = self._resolve_hit(req, st, client, keys, kinds, hits, num_computed_tokens // chunk)
        hit_tokens = st.hit_chunks * chunk
        if hit_tokens <= num_computed_tokens:
            self._release(st.pins)
            st.pins = []
            st.answer = (0, False)
        else:
            st.load = (num_computed_tokens, hit_tokens)
            n = hit_tokens - num_computed_tokens
            st.answer, st.answer_pass = (n, not self._load_sync(n)), self._pass
            self.stats["hit_tokens"] += n
        # Chunks kvd holds need not be stored again.
        st.stored_chunks = max(st.stored_chunks, st.hit_chunks)
        return st.answer

    def _load_sync(self, tokens: int) -> bool:
        """Whether a hit of ``tokens`` loads synchronously: always with ``load_mode`` sync;
        with auto, while this pass's synchronous loads, this one included, stay within
        ``sync_load_tokens`` (when set). A synchronous load holds the step's forward pass, every
        running request's next token with it, for its copy: eight conversations of ~4,500
        tokens coming back to a restarted engine at once waited 262-274 ms for their first token
        loaded together, 165-169 ms each loaded asynchronously (benches/RESULTS.md, session 29)."""
        if not self.sync_loads:
            return False
        budget = self.config.sync_load_tokens
        if self.config.load_mode == "sync" or budget is None:
            return True
        if self._sync_tokens + tokens > budget:
            return False
        self._sync_tokens += tokens
        return True

    def _absent_from(self, client: _native.Client, salt: int, hashes: list[int], needed: int) -> int | None:
        """Where kvd's presence filter says a prefix registration's chunks stop, when that is
        at or before chunk ``needed`` (the first one vLLM's own prefix cache does not cover in
        full), so that no hit can reach past what vLLM holds; None when kvd must be asked (no
        filter, no prefix registration, or every chunk up to ``needed`` may be held). The
        filter errs only towards "may be held"."""
        if not self.config.presence or needed >= len(hashes):
            return None
        ends = []
        for g, fp in self._keys():
            if self._kind(g) != "prefix":
                continue
            end = client.first_absent(fp, salt, g.shards[0], hashes[: needed + 1])
            if end is None:
                return None
            ends.append(end)
        return min(ends) if ends and min(ends) <= needed else None

    def _resolve_hit(self, req: SchedRequest, st: _State, client: _native.Client, keys: list[tuple[GroupInfo, int]],
                     kinds: list[str], hits: list[int], floor: int) -> int:
        """The longest hit loadable in every group: at most the prefix groups' (``st.hit_chunks``),
        with every "last" registration (a state group, a sliding group of chunk tails) holding
        the hit's last chunk and every "window" registration the chunks its window overlaps.

        Each registration's answer either confirms a candidate ``n``, rules it out (then ``n``
        drops to the most it allows, and the others are checked again there), or says nothing
        of it: a "last" lookup that found a later chunk, a prefix from chunk 0 that stops before
        the window (kvd restarted, or evicted the head). Those ask again for exactly what ``n``
        needs. A few rounds at most; the common case (every group holds the same prefix) asks
        nothing more."""
        n = st.hit_chunks
        #: "last" registrations: how many chunks their last lookup named.
        named = {i: st.asked for i, k in enumerate(kinds) if k == "last"}
        #: "window" registrations: their last lookup's first chunk, the chunks it found from
        #: there, and whether the chunk after those is known missing.
        seen = {i: (0, hits[i], hits[i] < st.asked) for i, k in enumerate(kinds) if k == "window"}
        for _ in range(8):
            if n <= floor:
                return 0
            m = n
            redo: dict[int, tuple[int, bool]] = {}
            for i, ((g, _), kind) in enumerate(zip(keys, kinds)):
                if kind == "last":
                    if hits[i] < n <= named[i]:
                        m = min(m, hits[i])  # none held in [hits[i], named[i]): not chunk n-1
                    elif hits[i] != n:
                        redo[i] = (0, True)
                elif kind == "window":
                    lo, (start, held, gap) = self._window_start(g, n), seen[i]
                    if start <= lo and start + held >= n:
                        continue
                    if gap and lo <= start + held < n:
                        m = min(m, start + held)  # a missing chunk inside the window
                    else:
                        redo[i] = (lo, False)
            if m < n:
                n = m
                continue
            if not redo:
                if any(g.state for g, _ in keys):
                    st.states.add(n - 1)
                return n
            hashes = st.hasher.known(n)
            self._release([st.pins[i] for i in redo])
            pending = {
                i: client.lookup(keys[i][1], req.salt, list(keys[i][0].shards), hashes[:n], pin=not st.peek,
                                 readers=keys[i][0].readers, last=True) if last
                else client.lookup(keys[i][1], req.salt, list(keys[i][0].shards), hashes[lo:n], pin=not st.peek,
                                   readers=keys[i][0].readers)
                for i, (lo, last) in redo.items()
            }
            failed = False
            for i, p in pending.items():
                try:
                    found, st.pins[i] = p.result(self.config.lookup_timeout_s)
                except (TimeoutError, _native.KvdError) as e:
                    log.warning("kvd: lookup for %s failed: %s", req.req_id, e)
                    if isinstance(e, TimeoutError):
                        self._late.append(p)
                    found, st.pins[i], failed = 0, 0, True
                lo = redo[i][0]
                if kinds[i] == "last":
                    hits[i], named[i] = found, n
                else:
                    seen[i] = (lo, found, found < n - lo)
            if failed:
                return 0
        return 0

    def _drop_lookup(self, req_id: str) -> None:
        """Forgets a request's lookup (answered or under way) and its pins: vLLM is told no hit."""
        st = self._reqs.get(req_id)
        if st is None or st.lookups is None:
            return
        if st.answer is not None:
            self._release(st.pins)  # the answer was read: these are its pins
        else:
            self._late.extend(st.lookups)  # under way: released when they land
        st.pins, st.lookups, st.answer, st.load, st.lookup_for = [], None, None, None, -1

    @staticmethod
    def _wait(pending: list[_native.Pending[tuple[int, int]]], until: float) -> None:
        """Waits (GIL released) until the lookups have answered or ``until`` has passed."""
        for p in pending:
            left = until - time.monotonic()
            if left <= 0:
                return
            try:
                p.result(left)
            except (TimeoutError, _native.KvdError):
                return

    # --- update_state_after_alloc ---------------------------------------------------------

    def update_state_after_alloc(self, req_id: str, block_ids: list[list[int]], num_external_tokens: int) -> None:
        """vLLM allocated blocks; with external tokens, plan the load into them. Pins vLLM does
        not need (it took none of the hit) are released."""
        st = self._reqs.get(req_id)
        if st is None:
            return
        st.block_ids = [list(b) for b in block_ids]
        sync = st.answer is not None and not st.answer[1]
        # vLLM has admitted the request, so the answer is spent: if it asks again (a failed load
        # it recomputes, a preemption), look up afresh rather than replay a stale answer. The
        # miss a failed load earned was this answer's.
        st.answer, st.lookups, st.lookup_for, st.failed_from = None, None, -1, None
        if num_external_tokens == 0:
            # Either vLLM declined the hit or this is the second call after an async load
            # (whose pins the load already consumed).
            if st.pins:
                self._release(st.pins)
                st.pins = []
            st.load = None
            return
        if st.load is None:
            return
        start, end = st.load
        st.loading, st.loading_sync = st.load, sync
        chunk = self.chunk_tokens
        groups: list[tuple[list[int], list[Chunk]]] = []
        invalid = False
        pins = iter(st.pins)
        hashes = st.hasher.known(end // chunk)
        for g, info in enumerate(self.groups):
            if info.ignored:
                groups.append(([], []))
                continue
            per = chunk // info.block_tokens
            first_block = start // info.block_tokens
            chunks: list[Chunk] = []
            if info.state:
                # The state after the hit's last token goes where vLLM reads the state a request
                # resumes from: the block of that boundary (vLLM allocated it; the rest is null).
                last = end // chunk - 1
                at = (last + 1) * per - 1
                b = st.block_ids[g][at] if at < len(st.block_ids[g]) else NULL_BLOCK
                if b == NULL_BLOCK:
                    log.error("kvd: vLLM gave %s no block for the state after token %d; its load fails and "
                              "vLLM recomputes it", req_id, end)
                    invalid = True
                chunks.append((hashes[last], [SKIP if b == NULL_BLOCK else b]))
                groups.append(([next(pins, 0) for _ in range(self.subs[g])], chunks))
                continue
            n = end // chunk
            # A sliding group reads only the blocks of the window before the hit's end.
            first_block = max(first_block, n * per - window_blocks(info.window, info.block_tokens)
                              if info.window is not None else 0)
            k = self._tail(info) or per
            for c in range(max(start // chunk, self._window_start(info, n)), n):
                # Blocks vLLM computed itself, those outside the window, and the null block
                # (vLLM needs nothing there) are left alone.
                lo = (c + 1) * per - k
                blocks = [
                    b if lo + i >= first_block and b != NULL_BLOCK else SKIP
                    for i, b in enumerate(st.block_ids[g][lo : lo + k])
                ]
                if any(b != SKIP for b in blocks):
                    chunks.append((hashes[c], blocks))
            groups.append(([next(pins, 0) for _ in range(self.subs[g])], chunks))
        if invalid:
            self._release(st.pins)
            groups = [([0] * len(pins), chunks) for pins, chunks in groups]
        self._loads.append(LoadOp(req_id=req_id, salt=st.salt, groups=groups, invalid=invalid, sync=sync))
        st.pins = []
        st.load = None

    def load_failed(self, req_id: str, chunks: Collection[int] = ()) -> None:
        """A worker reported the request's load failed: ``chunks`` are the hashes of the chunks
        it could not load, in any group (none: the whole load, as vLLM >= 0.33's
        ``failed_recving`` says of a request). vLLM recomputes from the first of them (a model
        of one group) or from the start (several groups); the next lookup asks for the chunks
        before it. A synchronous load's failure asks no lookup: vLLM recomputes it in the running
        request."""
        st = self._reqs.get(req_id)
        if st is None or st.loading_sync:
            return
        at = st.loading[0] if st.loading is not None else 0
        found = [i for i in (st.hasher.index(h) for h in chunks) if i is not None]
        if found:
            at = min(found) * self.chunk_tokens
        st.failed_from = at if st.failed_from is None else min(st.failed_from, at)

    # --- build_connector_meta -------------------------------------------------------------

    def build(
        self,
        scheduled: Sequence[tuple[SchedRequest, int, int, list[list[int]] | None]],
        preempted: Sequence[str] = (),
        written: Collection[int] | None = (),
    ) -> KvdMetadata:
        """The step's plan. ``scheduled`` holds (request, tokens computed before the step,
        tokens scheduled, block ids — None when unchanged since the last step); ``written``, the
        blocks vLLM writes on the model's stream before the forward pass (None: it cannot say
        which), into which a load must wait for that stream."""
        self._pass_waits = False
        self._pass += 1
        self._sync_tokens = 0
        if preempted:
            self._preempted_pass = self._pass
        self._order_loads(written)
        meta = KvdMetadata(loads=self._loads, delayed=self._delayed, preempted=list(preempted))
        self._loads, self._delayed = [], []
        self._release_late()
        if not self.config.store or (self.conn and self.conn.client() is None) or not self._usable():
            return meta
        chunk = self.chunk_tokens
        for req, computed, num_scheduled, block_ids in scheduled:
            if not req.cacheable:
                continue
            st = self._state(req)
            st.salt = req.salt
            if block_ids is not None:
                st.block_ids = [list(b) for b in block_ids]
            after = computed + num_scheduled
            limit = len(req.token_ids) if self.config.store_generated else req.num_prompt_tokens
            done_chunks = min(after, limit) // chunk
            first_step = st.steps == 0
            st.steps += 1
            states = self._state_chunks(st, computed, after, done_chunks, first_step)
            if done_chunks <= st.stored_chunks and not states:
                continue
            hashes = st.hasher.hashes(req.token_ids, done_chunks)
            groups: list[list[Chunk]] = []
            for g, info in enumerate(self.groups):
                if info.ignored:
                    groups.append([])
                    continue
                per = chunk // info.block_tokens
                blocks = st.block_ids[g] if g < len(st.block_ids) else []
                if info.state:
                    # The state after chunk c is the one block of its last boundary.
                    groups.append([(hashes[c], [b]) for c in states
                                   if (c + 1) * per <= len(blocks) and (b := blocks[(c + 1) * per - 1]) != NULL_BLOCK])
                    continue
                # A sliding group's blocks leave the request once they leave the window, and the
                # ids this side tracks may then belong to another request: an entry is stored
                # only from blocks vLLM still holds in this step, those at or after the window
                # of the tokens computed before it (``window_blocks``). That includes a chunk
                # vLLM computed before this step, e.g. the window of a prefix it found in its
                # own cache after kvd restarted. R-SWA (no window) frees other blocks: there only
                # chunks computed wholly in this step are stored. No group ever stores the null
                # block.
                if info.window is not None:
                    held = max(0, computed - info.window + 1) // info.block_tokens
                    first = st.stored_chunks
                else:
                    held = 0
                    first = st.stored_chunks if not info.sliding else max(st.stored_chunks, -(-computed // chunk))
                k = self._tail(info) or per
                groups.append([
                    (hashes[c], bs)
                    for c in range(first, done_chunks)
                    if (c + 1) * per - k >= held and len(bs := blocks[(c + 1) * per - k : (c + 1) * per]) == k
                    and NULL_BLOCK not in bs
                ])
            st.states.update(states)
            if any(groups):
                meta.stores.append(StoreOp(req_id=req.req_id, salt=req.salt, groups=groups, first_chunk=st.stored_chunks))
                st.stores_emitted = True
                self.stats["stored_chunks"] += max(0, done_chunks - st.stored_chunks)
            st.stored_chunks = max(st.stored_chunks, done_chunks)
        # Preempted requests need no reset here: update_state_after_alloc forgot their answers
        # when vLLM admitted them, and resetting now would drop (and leak the pin of) a lookup
        # started this very step, when a preemption between steps lets vLLM re-admit at once.
        return meta

    def blocks_freed(self, block_ids: Iterable[Iterable[int]]) -> None:
        """vLLM frees these blocks of a request that ended, now or once its stores are done
        (``request_finished`` names them): a load into one of them in the next two passes waits
        for the model's stream. A delayed free comes due only after the steps that used the
        blocks have been processed (their stores were done by then), so it is not counted again."""
        if self.overlap_loads:
            for ids in block_ids:
                self._freed[0].update(ids)

    def _order_loads(self, written: Collection[int] | None) -> None:
        """Marks which of this pass's loads wait for the model's stream (``LoadOp.wait``); the
        rest start at once, beside the forward pass still running."""
        if not self.overlap_loads:
            return
        recent, earlier = self._freed
        self._freed = (set(), recent)
        if self._pass - self._preempted_pass <= 1 or written is None:
            return
        for op in self._loads:
            op.wait = any(b in recent or b in earlier or b in written
                          for _, chunks in op.groups for _, blocks in chunks for b in blocks)
            self.stats["loads_overlapped"] += not op.wait

    def _state_chunks(self, st: _State, computed: int, after: int, done_chunks: int, first_step: bool) -> list[int]:
        """Chunks whose state a state group stores this step: the chunk this step's last token
        ends (vLLM keeps the state after a step that ends on a block boundary), and in a
        request's first step, the chunk its start ends (the state of a prefix vLLM found in its
        own cache, which kvd may lack: kvd restarted, or evicted it). None without state groups."""
        if not any(g.state for g in self.groups):
            return []
        chunk = self.chunk_tokens
        out = []
        if first_step and computed and computed % chunk == 0 and computed // chunk <= done_chunks:
            out.append(computed // chunk - 1)
        if after > computed and after % chunk == 0 and after // chunk <= done_chunks:
            out.append(after // chunk - 1)
        return [c for c in out if c not in st.states]

    # --- remembering prompts (kvd.warm_group) ---------------------------------------------

    def remember(self, prompt: Sequence[int], cache_salt: str | None) -> None:
        """Keeps a finished request's prompt in kvd under ``kvd.warm_group``, for warming this
        replica's replacement (``kvd.warm``). Never waits for kvd: replies are read on later
        calls, and a refusal is logged once. A prompt shorter than a chunk (nothing kvd holds)
        or longer than one frame carries is skipped."""
        group = self.config.warm_group
        if not group:
            return
        self._check_remembered()
        client = self.conn.client() if self.conn else None
        if client is None or len(prompt) < self.chunk_tokens:
            return
        if 4 * len(prompt) + 1024 > min(int(client.server["max_frame_bytes"]), MAX_REMEMBER_BYTES):
            return
        try:
            tokens = array.array("I", prompt).tobytes()
        except (OverflowError, TypeError):
            return
        try:
            pending = client.remember(group, cache_salt or "", tokens)
        except _native.KvdError as e:
            self._remember_failed(e)
            return
        if pending is not None:  # None: the client has its most in flight; this one is skipped
            self._remembering.append(pending)

    def _check_remembered(self) -> None:
        keep = []
        for p in self._remembering:
            if not p.done():
                keep.append(p)
                continue
            try:
                p.result()
                self.stats["remembered"] += 1
            except _native.KvdError as e:
                self._remember_failed(e)
        self._remembering = keep

    def _remember_failed(self, e: Exception) -> None:
        # kvd away or slow: the connection says so itself, and a refusal later must still be heard.
        if isinstance(e, _native.ConnectionLost):
            return
        if not self._remember_warned:
            self._remember_warned = True
            log.warning("kvd: kvd.warm_group %r: kvd did not remember a prompt (%s); this replica's "
                        "replacement cannot be warmed from kvd (logged once)", self.config.warm_group, e)

    # --- request_finished -----------------------------------------------------------------

    def request_finished(self, req_id: str) -> bool:
        """Whether vLLM must keep the request's blocks until its stores are done."""
        st = self._reqs.pop(req_id, None)
        if st is None:
            return False
        self._release(st.pins)
        if st.stores_emitted:
            self._delayed.append(req_id)
            return True
        return False

    def _release_late(self) -> None:
        keep = []
        for p in self._late:
            if not p.done():
                keep.append(p)
                continue
            try:
                _, pin = p.result()
            except _native.KvdError:
                continue
            self._release([pin])
        self._late = keep
