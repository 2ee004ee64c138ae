"""The worker side of the connector, independent of vLLM: registers the rank's KV caches with
kvd and turns each step's plan into stores and retrieves — submitted after an interprocess
event recorded on the model's stream, completed by kvd's own event, never waited on by the
forward pass.

A failed or missing load is reported as load errors (vLLM recomputes those blocks), never as a
crash; a lost connection turns every in-flight operation into a miss until kvd is back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvd import _native
from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.groups import window_entry
from kvd.layout import KvLayoutSpec, TensorLike, by_shape, describe, device_of
from kvd.metadata import SKIP, Chunk, KvdMetadata
from kvd.scheduler import sub_fingerprint

log = logging.getLogger("kvd")

LOADED, STORED = _native.LOADED, _native.STORED
ALREADY_STORED, REFUSED = _native.ALREADY_STORED, (_native.REFUSED_POOL_FULL, _native.SKIPPED)

#: At most this many per-transfer sizes (and stored chunk keys) wait to be taken; beyond it they
#: are dropped and counted, so a worker whose stats nobody drains stays bounded.
MAX_RECORDS = 4096

#: Seconds past a copy's deadline that the worker still waits for kvd's answer before taking
#: the blocks back. kvd starts no copy after the deadline (it checks on the thread that hands
#: the copy to the device, just before); one it started just before is under way by then, and
#: its answer on the wire: this covers that answer's trip and the copy itself (a second is
#: tens of GB at the link's rate).
COPY_GRACE_S = 1.0


def _deadline(after_s: float) -> tuple[float, int]:
    """A copy's deadline ``after_s`` from now: (``time.monotonic()`` seconds, the
    ``CLOCK_MONOTONIC`` nanoseconds kvd is sent; the host's processes share that clock)."""
    ns = time.monotonic_ns() + int(after_s * 1e9)
    return ns / 1e9, ns


@dataclass(frozen=True)
class WorkerGroup:
    """One KV-cache group as this rank registers it."""

    fingerprint: int
    #: The KV shard this rank holds (its TP rank; 0 for MLA, which every rank shares).
    shard: int
    #: Whether this rank stores the group (False for MLA on ranks other than 0).
    store: bool = True
    #: Sliding-window group: vLLM may free and reuse a stored block in the very next step, so
    #: that step's forward waits (on the GPU) for kvd to have copied it.
    sliding: bool = False
    #: Tokens one block of the group covers (vLLM's block size), when known: a layer whose
    #: blocks hold fewer rows than that is compressed (one state per several tokens).
    block_tokens: int | None = None
    #: A group kvd neither stores nor loads: nothing of it is registered.
    ignored: bool = False
    #: A state group (Mamba): each layer's state tensors are registered with one block per
    #: chunk (the state at the chunk's end); its stores are ordered like a sliding window's.
    state: bool = False
    #: A sliding group's window in tokens: when the window fits in a chunk, an entry holds only
    #: the chunk's tail (``kvd.groups.window_entry``), and the registration says so.
    window: int | None = None


@dataclass
class TransferStats:
    """Finished copies since the last ``KvdWorker.take_stats``: what vLLM's offload metrics
    count. Seconds run from submitting a copy to ``get_finished`` seeing it complete (so they
    include up to one step of polling delay); bytes are the blocks actually copied."""

    load_bytes: int = 0
    load_seconds: float = 0.0
    #: Bytes of each finished retrieve (one per group and request).
    load_sizes: list[int] = field(default_factory=list)
    store_bytes: int = 0
    store_seconds: float = 0.0
    store_sizes: list[int] = field(default_factory=list)
    #: Chunks kvd refused to store (pool full of pinned pages, or after such a refusal).
    store_refused_chunks: int = 0
    #: Sizes left out because more than MAX_RECORDS waited.
    dropped_sizes: int = 0

    def is_empty(self) -> bool:
        return not (self.load_sizes or self.store_sizes or self.store_refused_chunks or self.dropped_sizes)


@dataclass
class _Copy:
    """One store or retrieve of one group."""

    reg: _native.Registration
    pending: _native.Pending[tuple[bytes, int | None]]
    chunks: list[Chunk]
    epoch: int
    reply: tuple[list[int], int | None] | None = None
    failed: bool = False
    #: Index of the group, the request's salt and when the copy was submitted (for stats).
    group: int = 0
    salt: int = 0
    started: float = field(default_factory=time.monotonic)
    #: Which registration of the group (one per layer shape).
    sub: int = 0
    #: ``time.monotonic()`` after which kvd starts no copy of it (inf: none was given).
    deadline: float = float("inf")
    #: kvd did not answer in time: it may still start the copy, up to the deadline.
    timed_out: bool = False

    def poll(self) -> bool:
        """True once the copy has completed (or failed)."""
        if self.failed:
            return True
        if self.reply is None:
            if not self.pending.done():
                return False
            try:
                outcomes, slot = self.pending.result()
            except _native.KvdError as e:
                log.debug("kvd: copy failed: %s", e)
                self.failed = True
                self.timed_out = isinstance(e, _native.TimedOut)
                return True
            self.reply = (list(outcomes), slot)
        _, slot = self.reply
        if slot is None:
            return True
        try:
            return self.reg.query(slot)
        except _native.KvdError as e:
            log.warning("kvd: polling kvd's event failed: %s", e)
            self.failed = True
            return True


@dataclass
class _Load:
    copies: list[_Copy]
    started: float
    #: ``time.monotonic()`` after which kvd writes none of its blocks.
    deadline: float
    #: Part of the load could not be sent: it fails once the parts that were sent are done
    #: (until then kvd may write the request's blocks).
    failed: bool = False


class KvdWorker:
    """Worker-side logic of the kvd connector for one rank."""

    def __init__(
        self,
        config: KvdConfig,
        conn: Connection,
        groups: Sequence[WorkerGroup],
        current_stream: Callable[[], int] = lambda: 0,
    ) -> None:
        self.config = config
        self.conn = conn
        self.groups = list(groups)
        self.current_stream = current_stream
        #: Per group, one layout per distinct layer shape (usually one).
        self._specs: list[list[KvLayoutSpec]] = []
        self._views: list[list[list[TensorLike]]] = []
        self._kinds: list[str | None] = []
        self._device = "cuda"
        self._regs: list[list[_native.Registration | None]] = []
        #: Stores of sliding-window groups submitted last step (see ``WorkerGroup.sliding``).
        self._guard: list[_Copy] = []
        self._epoch = 0
        self._slot = 0
        self._loads: dict[str, _Load] = {}
        self._stores: dict[str, list[_Copy]] = {}
        self._delayed: set[str] = set()
        self._errors: set[int] = set()
        self._failed: set[str] = set()
        #: Hashes of the chunks each request could not load, since the last ``take_failed_chunks``.
        self._failed_chunks: dict[str, set[int]] = {}
        #: Loads that failed before they started; reported as finished (and failed) next poll.
        self._failed_early: set[str] = set()
        self.stats = {"loaded_chunks": 0, "missing_chunks": 0, "stored_chunks": 0, "failed_loads": 0, "refused_chunks": 0}
        self._transfers = TransferStats()
        #: Collect the keys of chunks this rank's stores put in kvd, for ``take_stored`` (the
        #: connector turns them into vLLM's KV events when those are on).
        self.report_stored = False
        self._stored: list[tuple[int, int, int, int]] = []
        self.dropped_stored = 0

    # --- registration ---------------------------------------------------------------------

    def register(self, views_per_group: Sequence[Sequence[TensorLike]], kinds: Sequence[str | None] | None = None) -> None:
        """Describes each group's layers and registers them now (if kvd is up) and again after
        every reconnection."""
        if len(views_per_group) != len(self.groups):
            raise ValueError(f"{len(views_per_group)} groups of KV tensors for {len(self.groups)} configured groups")
        kinds = kinds or [None] * len(views_per_group)
        # A state group's layout, and a sliding group's whose entries are chunk tails, depend on
        # kvd's chunk size: described here to catch what cannot be registered, again at each
        # registration with kvd's size.
        self._views = [[] if g.ignored else by_shape(v) for v, g in zip(views_per_group, self.groups)]
        self._kinds = list(kinds)
        self._specs = self._describe(self.config.chunk_tokens)
        self._device = device_of(next(v for views in views_per_group for v in views))
        self._regs = [[None] * len(specs) for specs in self._specs]
        self.conn.on_connect(self._register_all)

    def _describe(self, chunk_tokens: int) -> list[list[KvLayoutSpec]]:
        return [
            [describe(s, k, self._entry_span(g, chunk_tokens), state=g.state) for s in shapes]
            for shapes, k, g in zip(self._views, self._kinds, self.groups)
        ]

    @staticmethod
    def _entry_span(g: WorkerGroup, chunk_tokens: int) -> int | None:
        """The tokens one registered block stands for, so that kvd's chunk is the entry's
        blocks: the whole chunk for a state group (one state per chunk), a chunk's share of
        the tail blocks for a sliding group whose entries are tails, else the block size."""
        if g.state:
            return chunk_tokens
        if g.window is not None and g.block_tokens is not None:
            tail = window_entry(g.window, g.block_tokens, chunk_tokens)
            if tail is not None:
                return chunk_tokens // tail
        return g.block_tokens

    @property
    def subs(self) -> list[int]:
        """Registrations per group: the number of distinct layer shapes in each."""
        return [len(specs) for specs in self._specs]

    def _register_all(self, client: _native.Client) -> None:
        if any(g.state or g.window is not None for g in self.groups):
            self._specs = self._describe(int(client.server["chunk_tokens"]))
        self._regs = [
            [self._register(client, g, sub_fingerprint(g.fingerprint, k, len(specs)), spec) for k, spec in enumerate(specs)]
            for g, specs in zip(self.groups, self._specs)
        ]
        self._epoch += 1
        regs = [r for group in self._regs for r in group]
        shared = {r.shared_by for r in regs if r is not None}
        log.info("kvd: registered %d of %d KV cache registration(s) with kvd (shared by %s)",
                 sum(r is not None for r in regs), len(regs), ", ".join(sorted(shared)) or "nothing")

    def _register(self, client: _native.Client, g: WorkerGroup, fp: int, spec: KvLayoutSpec) -> _native.Registration | None:
        try:
            return client.register(fp, g.shard, self._device, spec.layer_ptrs, spec.layout, events=self.config.events)
        except _native.VmmMemoryError as e:
            log.error("kvd: cannot register the KV cache: %s", e)
        except _native.ServerError as e:
            if isinstance(e, (_native.NotReady, _native.Busy)):
                # kvd is still populating its pool (it just restarted): try again shortly.
                log.info("kvd: kvd is not ready for the registration yet (%s); retrying", e.args[1] if len(e.args) > 1 else e)
                self.conn.retry_hooks(1.0)
            else:
                log.error("kvd: kvd refused the KV cache registration: %s", e)
        except _native.DeviceError as e:
            log.error("kvd: the CUDA driver failed while registering the KV cache: %s", e)
        return None

    def unregister(self) -> None:
        """Drops the registrations (vLLM is about to release the KV memory, e.g. sleep mode)."""
        client = self.conn.client()
        for r in self.registrations:
            if r is not None and client is not None:
                try:
                    client.unregister(r.region)
                except _native.KvdError:
                    pass
        self._regs = [[None] * len(group) for group in self._regs]

    def restore(self) -> None:
        """Registers again after the KV memory came back (sleep mode wake-up)."""
        client = self.conn.client()
        if client is not None:
            self._register_all(client)

    def ready(self) -> bool:
        """Whether this rank can load now: connected to kvd, with every registration of every
        group kvd serves in place (after a reconnection they come back once kvd accepts them,
        which a kvd still populating its pool may refuse for a while)."""
        if self.conn.client() is None or not self._regs:
            return False
        return all(r is not None for g, regs in zip(self.groups, self._regs) if not g.ignored for r in regs)

    @property
    def registrations(self) -> list[_native.Registration | None]:
        """Every registration, group by group."""
        return [r for group in self._regs for r in group]

    def _event(self, reg: _native.Registration) -> int | None:
        """Records the next client event slot on the model's stream; None for host memory."""
        if reg.num_events == 0:
            return None
        slot = self._slot % reg.num_events
        self._slot += 1
        reg.record(slot, self.current_stream())
        return slot

    def _live(self) -> tuple[_native.Client | None, list[list[_native.Registration | None]]]:
        client = self.conn.client()
        return client, (self._regs if client is not None else [[None] * len(g) for g in self._regs])

    # --- loads ----------------------------------------------------------------------------

    def before_forward(self, meta: KvdMetadata) -> None:
        """What must precede the step's forward pass: its delayed frees, and ordering it after
        kvd's copies of last step's sliding-window and state stores (vLLM may have handed
        those blocks to another request, which this forward writes into). vLLM >= 0.33 calls
        ``start_load_kv`` only after launching the forward, so the connector calls this from
        ``bind_connector_metadata``; ``start_load`` calls it too (a no-op the second time)."""
        self._delayed.update(meta.delayed)
        self._wait_for_guarded_stores()

    def start_load(self, meta: KvdMetadata) -> None:
        """Takes the step's delayed frees and submits its retrieves. Returns at once for
        asynchronous loads; a synchronous one (``LoadOp.sync``: the request is in this step's
        forward) returns once the model's stream waits for kvd's copy, or once kvd can no longer
        start it (its deadline, ``sync_load_timeout_s``, and the grace have passed: the load
        fails and vLLM recomputes those tokens).

        vLLM calls this every step, also a step that runs no forward pass (nothing could be
        scheduled: ``kv_connector_no_forward``), where it calls no ``wait_for_save``. Delayed
        frees must be taken here: a step with nothing scheduled may be waiting for exactly the
        blocks they hold, and taking them only in ``save`` livelocked vLLM 0.26 on the H200."""
        self.before_forward(meta)
        client, regs = self._live()
        # By the time a request kvd did not answer times out here, kvd starts no copy of it.
        timeout = min(self.config.load_timeout_s, self.config.request_timeout_s)
        deadlines = {False: _deadline(timeout), True: _deadline(min(timeout, self.config.sync_load_timeout_s))}
        for op in meta.loads:
            chunks_of_op = [c for _, cs in op.groups for c in cs]
            if op.invalid:
                self._fail_load(op.req_id, chunks_of_op)
                if not op.sync:
                    self._failed_early.add(op.req_id)
                continue
            deadline, deadline_ns = deadlines[op.sync]
            copies = []
            ok = client is not None
            for g, (pins, chunks) in enumerate(op.groups):
                if not chunks:
                    continue
                # Every registration of every group must load, or the load fails: a group this
                # rank could not register leaves nothing loaded that vLLM would take as loaded.
                group_regs = regs[g] if g < len(regs) and regs[g] else [None]
                for k, reg in enumerate(group_regs):
                    pin = pins[k] if k < len(pins) else 0
                    if reg is None or client is None:
                        ok = False
                        continue
                    try:
                        slot = self._event(reg) if op.wait else None
                        p = client.retrieve(reg.region, op.salt, chunks, pin_id=pin, wait_slot=slot, deadline_ns=deadline_ns)
                    except _native.KvdError as e:
                        self.conn.lost(e)
                        ok = False
                        continue
                    copies.append(_Copy(reg, p, chunks, self._epoch, group=g, salt=op.salt, sub=k, deadline=deadline))
            if op.sync:
                self._finish_sync_load(op.req_id, copies, chunks_of_op if not ok else [])
            elif not ok and not copies:
                self._fail_load(op.req_id, chunks_of_op)
                self._failed_early.add(op.req_id)
            else:
                self._loads[op.req_id] = _Load(copies, time.monotonic(), deadline, failed=not ok)

    def _finish_sync_load(self, req_id: str, copies: list[_Copy], unsent: list[Chunk]) -> None:
        """Orders the model's stream after a synchronous load's copies (or waits until kvd can
        no longer start them) and accounts it: what failed is reported as blocks to recompute."""
        for c in copies:
            self._order_after(c, "a load")
        now = time.monotonic()
        if unsent:
            self._fail_load(req_id, unsent)
            return
        for c in copies:
            self._account_load(req_id, c)
            self._record_load(c, now)

    def _fail_load(self, req_id: str, chunks: list[Chunk]) -> None:
        self.stats["failed_loads"] += 1
        self._failed.add(req_id)
        self._failed_chunks.setdefault(req_id, set()).update(h for h, _ in chunks)
        for _, blocks in chunks:
            self._errors.update(b for b in blocks if b != SKIP)

    # --- stores ---------------------------------------------------------------------------

    def save(self, meta: KvdMetadata) -> None:
        """Submits the step's stores after the forward pass (ordered by an event on the model's
        stream, not by waiting); returns at once."""
        # A step's delayed frees are normally taken by start_load; a caller that runs only
        # save (tests, tools) still gets them reported.
        self._delayed.update(meta.delayed)
        if not meta.stores:
            return
        client, regs = self._live()
        if client is None:
            return
        # Blocks of a sliding window (or of a request vLLM preempts) may be reused from the
        # next step on: kvd must start these copies by the deadline or not at all.
        deadline, deadline_ns = _deadline(self.config.store_deadline_s)
        slots: dict[tuple[int, int], int | None] = {}
        for op in meta.stores:
            for g, (chunks, group_regs, group) in enumerate(zip(op.groups, regs, self.groups)):
                if not chunks or not group.store:
                    continue
                for k, reg in enumerate(group_regs):
                    if reg is None:
                        continue
                    try:
                        if (g, k) not in slots:
                            slots[g, k] = self._event(reg)
                        p = client.store(reg.region, op.salt, chunks, wait_slot=slots[g, k], deadline_ns=deadline_ns)
                    except _native.KvdError as e:
                        self.conn.lost(e)
                        return
                    copy = _Copy(reg, p, chunks, self._epoch, group=g, salt=op.salt, sub=k, deadline=deadline)
                    self._stores.setdefault(op.req_id, []).append(copy)
                    if group.sliding or group.state:
                        self._guard.append(copy)

    def _wait_for_guarded_stores(self) -> None:
        """Orders the coming forward pass after kvd's copies of last step's sliding-window
        stores: vLLM may have freed those blocks since and handed them to another request. The
        host waits only for kvd's replies (the copies are queued by then); the model's stream
        waits on kvd's events."""
        guard, self._guard = self._guard, []
        for c in guard:
            self._order_after(c, "a sliding-window store")

    def _order_after(self, c: _Copy, what: str) -> None:
        """Makes the model's stream wait for kvd's copy of ``c``, or returns once kvd can no
        longer start it: its answer came (the stream waits on kvd's event), kvd refused it (an
        error reply, ``Expired`` among them: nothing copied), or, with no answer (kvd stopped,
        stuck, or the connection gone), once the deadline and ``COPY_GRACE_S`` have passed: kvd
        starts no copy after the deadline, so the blocks are vLLM's again. The connection is
        then dropped, and stores resume once kvd answers a new one. Never sooner: a forward
        that ran ahead of a copy kvd starts later would leave another request's bytes under this
        one's keys."""
        if c.reply is None:
            try:
                outcomes, slot = c.pending.result(max(0.0, c.deadline + COPY_GRACE_S - time.monotonic()))
                c.reply = (list(outcomes), slot)
            except _native.Expired:
                c.failed = True
                log.info("kvd: %s came after its deadline; kvd copied nothing (a lagging kvd costs hits, not bytes)", what)
                return
            except _native.ServerError as e:
                c.failed = True
                log.warning("kvd: kvd refused %s: %s", what, e)
                return
            except (_native.KvdError, TimeoutError) as e:
                # No answer: the request may still sit unread in kvd, which may start it up to
                # the deadline (the client's own timeout or a broken connection says nothing of
                # that).
                c.failed = True
                time.sleep(max(0.0, c.deadline + COPY_GRACE_S - time.monotonic()))
                log.warning("kvd: %s got no answer by its deadline (%s); kvd starts no copy of it now. The "
                            "connection is dropped until kvd answers again", what, e)
                self.conn.lost(e)
                return
        if c.reply is not None and c.reply[1] is not None:
            c.reg.stream_wait(c.reply[1], self.current_stream())

    def handle_preemptions(self, meta: KvdMetadata) -> None:
        """A preempted request's blocks may be overwritten by the next forward: make the model's
        stream wait for its pending stores (kvd's events; the host waits only for replies)."""
        for req_id in meta.preempted:
            for c in self._stores.pop(req_id, []):
                self._order_after(c, "a preempted request's store")

    # --- completion -----------------------------------------------------------------------

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving): delayed requests whose stores are done, and
        requests whose loads are done (failed ones included, see ``failed_loads``)."""
        recving, self._failed_early = self._failed_early, set()
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            # A copy kvd did not answer in time may still be started up to the deadline: its
            # blocks stay kvd's until then (reported after it, as failed; vLLM recomputes).
            if all(c.poll() for c in load.copies) and (
                    now > load.deadline + COPY_GRACE_S or not any(c.timed_out for c in load.copies)):
                del self._loads[req_id]
                recving.add(req_id)
                if load.failed:
                    self._fail_load(req_id, [ch for c in load.copies for ch in c.chunks])
                    continue
                for c in load.copies:
                    self._account_load(req_id, c)
                    self._record_load(c, now)
            elif now > load.deadline + COPY_GRACE_S:
                # kvd starts none of its copies after the deadline: the blocks are vLLM's again.
                log.warning("kvd: load of %s timed out after %.1f s; vLLM recomputes it", req_id, now - load.started)
                del self._loads[req_id]
                recving.add(req_id)
                self._fail_load(req_id, [ch for c in load.copies for ch in c.chunks])
                self.conn.lost("a load timed out")
        for req_id, copies in list(self._stores.items()):
            if all(c.poll() for c in copies):
                del self._stores[req_id]
                for c in copies:
                    if c.reply is not None:
                        self.stats["stored_chunks"] += sum(o == STORED for o in c.reply[0])
                        self.stats["refused_chunks"] += sum(o in REFUSED for o in c.reply[0])
                        self._record_store(c, now)
        sending = {r for r in self._delayed if r not in self._stores}
        self._delayed -= sending
        return sending, recving

    def _account_load(self, req_id: str, c: _Copy) -> None:
        if c.failed or c.reply is None or c.epoch != self._epoch:
            self._fail_load(req_id, c.chunks)
            return
        outcomes, _ = c.reply
        missing = [ch for ch, o in zip(c.chunks, outcomes) if o != LOADED]
        self.stats["loaded_chunks"] += len(c.chunks) - len(missing)
        if missing:
            self.stats["missing_chunks"] += len(missing)
            self._fail_load(req_id, missing)

    # --- what vLLM's metrics and KV events read ---------------------------------------------

    def _copied_bytes(self, c: _Copy, done: Sequence[bool]) -> int:
        """Bytes of the blocks a copy moved: of each done chunk's page, the share of its blocks
        that were not SKIP (a page is one chunk of every layer of the registration)."""
        per_block = c.reg.page_bytes // max(1, c.reg.chunk_blocks)
        blocks = sum(sum(b != SKIP for b in blocks) for (_, blocks), ok in zip(c.chunks, done) if ok)
        return blocks * per_block

    def _record_size(self, sizes: list[int], nbytes: int) -> None:
        if len(sizes) < MAX_RECORDS:
            sizes.append(nbytes)
        else:
            self._transfers.dropped_sizes += 1

    def _record_load(self, c: _Copy, now: float) -> None:
        if c.failed or c.reply is None or c.epoch != self._epoch:
            return
        nbytes = self._copied_bytes(c, [o == LOADED for o in c.reply[0]])
        if nbytes:
            t = self._transfers
            t.load_bytes += nbytes
            t.load_seconds += max(0.0, now - c.started)
            self._record_size(t.load_sizes, nbytes)

    def _record_store(self, c: _Copy, now: float) -> None:
        assert c.reply is not None
        outcomes = c.reply[0]
        t = self._transfers
        t.store_refused_chunks += sum(o in REFUSED for o in outcomes)
        nbytes = self._copied_bytes(c, [o == STORED for o in outcomes])
        if nbytes:
            t.store_bytes += nbytes
            t.store_seconds += max(0.0, now - c.started)
            self._record_size(t.store_sizes, nbytes)
        # A chunk is reported once per group: by its first registration's store.
        if self.report_stored and c.group < len(self.groups) and c.sub == 0:
            shard = self.groups[c.group].shard
            for (h, _), o in zip(c.chunks, outcomes):
                if o not in (STORED, ALREADY_STORED):
                    continue
                if len(self._stored) < MAX_RECORDS:
                    self._stored.append((c.group, c.salt, shard, h))
                else:
                    self.dropped_stored += 1

    def take_stats(self) -> TransferStats:
        """The copies finished since the last call (and resets them)."""
        t, self._transfers = self._transfers, TransferStats()
        return t

    def take_stored(self) -> list[tuple[int, int, int, int]]:
        """(group, salt, shard, chunk hash) of the chunks this rank's stores put in kvd (or found
        there) since the last call; empty unless ``report_stored`` is set."""
        s, self._stored = self._stored, []
        return s

    def load_errors(self) -> set[int]:
        """Block ids whose load failed since the last call (vLLM recomputes them)."""
        e, self._errors = self._errors, set()
        return e

    def failed_loads(self) -> set[str]:
        """Requests with a failed load since the last call."""
        f, self._failed = self._failed, set()
        return f

    def take_failed_chunks(self) -> dict[str, set[int]]:
        """Per request, the hashes of the chunks whose load failed since the last call (the
        scheduler's next lookup for it asks only for the chunks before the first of them)."""
        f, self._failed_chunks = self._failed_chunks, {}
        return f

    def has_pending(self) -> bool:
        return bool(self._loads or self._stores)

    def shutdown(self) -> None:
        deadline = time.monotonic() + min(5.0, self.config.request_timeout_s)
        while self.has_pending() and time.monotonic() < deadline:
            self.get_finished()
            time.sleep(0.001)
        self.conn.close()
