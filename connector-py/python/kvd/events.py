"""kvd's tier in vLLM's KV cache events, independent of vLLM.

KV-aware routers learn where a prefix lives from vLLM's event stream: ``BlockStored`` when blocks
land on a medium, ``BlockRemoved`` when they leave it. vLLM announces its GPU blocks itself; this
module announces kvd's copies, as vLLM 0.33's OffloadingConnector announces its CPU tier, with
vLLM's own block hashes (a router cannot know kvd's chunk keys) and medium ``"CPU"``:

- **planned**: when the scheduler plans a store it snapshots, per chunk and group, what
  ``BlockStored`` carries (vLLM's block hashes of the chunk, the parent hash, the chunk's
  tokens, block size, LoRA, group), because the request may be gone when the store completes;
- **stored**: when the workers report (through vLLM's worker metadata) that every shard the
  group needs holds the chunk, ``BlockStored`` is announced; snapshots whose stores never
  complete (refused, lost) expire after ``pending_timeout_s``;
- **removed**: kvd's eviction feed names evicted keys (fingerprint, salt, shard, chunk hash);
  an announced chunk one of whose shards is evicted is announced removed. When the feed says it
  dropped records, or kvd restarted, the tracker cannot know what is left, so it announces every
  chunk it tracks removed and forgets them (a router then under- rather than over-estimates).

Memory is bounded: at most ``max_chunks`` chunks are tracked; beyond it the oldest is forgotten
(announced removed first, if it was announced), and stores in flight are kept in planning order
so that expiring them looks at the oldest only. Only groups whose blocks make a prefix on their own (full
attention, MLA) are announced; sliding-window and state groups are not (vLLM 0.33's offloading
connector announces only placeholders for them).

The events are built with the classes the caller passes (vLLM's ``BlockStored`` and
``BlockRemoved``), by keyword, so this module never imports vLLM.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from kvd import _native

#: The medium vLLM names host memory with (vllm.distributed.kv_events.MEDIUM_CPU).
MEDIUM = "CPU"

#: Kinds of KV cache group (vLLM's KVCacheSpecKind values) whose stored chunks are announced.
PREFIX_KINDS = frozenset({"full_attention", "mla_attention"})

#: A chunk as the tracker keys it: (group fingerprint, salt, chunk hash).
Key = tuple[int, int, int]


@dataclass(frozen=True)
class EventGroup:
    """One KV-cache group as the events see it."""

    fingerprint: int
    #: Tokens per block of this group.
    block_tokens: int
    #: Shards that must all hold a chunk before it counts as stored (GroupInfo.shards).
    shards: tuple[int, ...]
    #: vLLM's kind of the group (KVCacheSpecKind value) and sliding window, carried in events.
    kind: str | None = "full_attention"
    sliding_window: int | None = None

    @property
    def announced(self) -> bool:
        return self.kind in PREFIX_KINDS and self.sliding_window is None


@dataclass(frozen=True)
class EventRequest:
    """What a chunk's events carry of its request, taken while vLLM's request is alive."""

    token_ids: Sequence[int]
    #: Per group: vLLM's hash of each block of the request, at the group's block size.
    block_hashes: Sequence[Sequence[Any]]
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class _Chunk:
    group: int
    block_hashes: tuple[Any, ...]
    parent: Any
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    lora_name: str | None
    #: Shards not yet reported holding the chunk; empty once announced.
    waiting: set[int]
    planned_at: float

    @property
    def announced(self) -> bool:
        return not self.waiting


@dataclass
class KvEvents:
    """Tracks the chunks of kvd's tier that vLLM's event stream has been told about."""

    groups: Sequence[EventGroup]
    #: Most chunks tracked at once (each ~ its block hashes and tokens: ~2-3 KB at 256 tokens).
    max_chunks: int = 100_000
    #: Seconds a planned store may take to be reported before its snapshot is dropped.
    pending_timeout_s: float = 120.0
    now: Callable[[], float] = time.monotonic
    #: Stores in flight (oldest first, so expiry looks at the front only) and announced chunks
    #: (oldest first, so the bound forgets the oldest).
    _pending: OrderedDict[Key, _Chunk] = field(default_factory=OrderedDict)
    _announced: OrderedDict[Key, _Chunk] = field(default_factory=OrderedDict)
    _stored: list[_Chunk] = field(default_factory=list)
    _removed: list[_Chunk] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=lambda: {
        "stored": 0, "removed": 0, "expired": 0, "forgotten": 0, "resyncs": 0, "feed_dropped": 0,
    })

    # --- the scheduler plans a store ------------------------------------------------------

    def planned(self, req: EventRequest, salt: int, chunk_tokens: int, first_chunk: int,
                groups: Sequence[Sequence[int]]) -> None:
        """A store of chunk hashes ``groups[g]`` (chunks ``first_chunk``, ``first_chunk + 1``,
        ... of the request) was planned; snapshots what their events will carry."""
        now = self.now()
        for g, (info, hashes) in enumerate(zip(self.groups, groups)):
            if not info.announced or not hashes:
                continue
            per = chunk_tokens // info.block_tokens
            block_hashes = req.block_hashes[g] if g < len(req.block_hashes) else ()
            for i, h in enumerate(hashes):
                c = first_chunk + i
                first, end = c * per, (c + 1) * per
                if end > len(block_hashes) or (c + 1) * chunk_tokens > len(req.token_ids):
                    continue  # vLLM has not hashed these blocks: nothing a router could match
                key = (info.fingerprint, salt, h)
                if key in self._pending or key in self._announced:
                    continue  # tracked already
                self._pending[key] = _Chunk(
                    group=g,
                    block_hashes=tuple(block_hashes[first:end]),
                    parent=block_hashes[first - 1] if first > 0 else None,
                    token_ids=tuple(req.token_ids[c * chunk_tokens:(c + 1) * chunk_tokens]),
                    block_size=info.block_tokens,
                    lora_id=req.lora_id,
                    lora_name=req.lora_name,
                    waiting=set(info.shards),
                    planned_at=now,
                )
        self._bound()

    # --- the workers report stores done ---------------------------------------------------

    def stored(self, records: Iterable[tuple[int, int, int, int]]) -> None:
        """Workers report (group, salt, shard, chunk hash) held by kvd after their stores."""
        for g, salt, shard, h in records:
            if g >= len(self.groups):
                continue
            key = (self.groups[g].fingerprint, salt, h)
            ch = self._pending.get(key)
            if ch is None:
                continue
            ch.waiting.discard(shard)
            if ch.announced:
                del self._pending[key]
                self._announced[key] = ch
                self._stored.append(ch)
                self.stats["stored"] += 1

    # --- kvd evicts -----------------------------------------------------------------------

    def removed(self, records: Iterable[tuple[int, int, int, int]]) -> None:
        """kvd's eviction feed: (fingerprint, salt, shard, chunk hash) no longer stored. A chunk
        missing any shard is no longer a hit, so it is announced removed."""
        for fp, salt, _shard, h in records:
            key = (fp, salt, h)
            self._pending.pop(key, None)
            ch = self._announced.pop(key, None)
            if ch is not None:
                self._removed.append(ch)
                self.stats["removed"] += 1

    def lost_track(self, why: str = "resync") -> None:
        """kvd's contents are unknown (it restarted, or its feed dropped records): every
        announced chunk is announced removed, and in-flight snapshots are dropped."""
        self._removed.extend(self._announced.values())
        self.stats["removed"] += len(self._announced)
        self._announced.clear()
        self._pending.clear()
        self.stats["resyncs"] += 1

    # --- draining -------------------------------------------------------------------------

    def take(self, stored_cls: Callable[..., Any], removed_cls: Callable[..., Any],
             convert: Callable[[Any], Any] = lambda h: h) -> list[Any]:
        """The events since the last call, oldest first: removals first (a chunk removed and
        stored again in one step ends stored), each built as ``stored_cls(**fields)`` /
        ``removed_cls(**fields)`` with vLLM's field names; ``convert`` maps a block hash to the
        form vLLM publishes (``maybe_convert_block_hash``)."""
        self._expire()
        out: list[Any] = []
        by_group: dict[int, list[Any]] = {}
        for ch in self._removed:
            by_group.setdefault(ch.group, []).extend(convert(b) for b in ch.block_hashes)
        for g, hashes in by_group.items():
            out.append(removed_cls(block_hashes=hashes, medium=MEDIUM, group_idx=g))
        for ch in self._stored:
            info = self.groups[ch.group]
            out.append(stored_cls(
                block_hashes=[convert(b) for b in ch.block_hashes],
                parent_block_hash=convert(ch.parent) if ch.parent is not None else None,
                token_ids=list(ch.token_ids),
                block_size=ch.block_size,
                lora_id=ch.lora_id,
                medium=MEDIUM,
                lora_name=ch.lora_name,
                group_idx=ch.group,
                kv_cache_spec_kind=info.kind,
                kv_cache_spec_sliding_window=info.sliding_window,
            ))
        self._removed, self._stored = [], []
        return out

    def __len__(self) -> int:
        return len(self._pending) + len(self._announced)

    def _expire(self) -> None:
        limit = self.now() - self.pending_timeout_s
        while self._pending:
            key, ch = next(iter(self._pending.items()))
            if ch.planned_at >= limit:
                break
            del self._pending[key]
            self.stats["expired"] += 1

    def _bound(self) -> None:
        while len(self) > self.max_chunks:
            self.stats["forgotten"] += 1
            pending = next(iter(self._pending.values()), None)
            announced = next(iter(self._announced.values()), None)
            if announced is None or (pending is not None and pending.planned_at < announced.planned_at):
                self._pending.popitem(last=False)
                continue
            # Untracked, its eviction would go unannounced: announce it gone now.
            self._announced.popitem(last=False)
            self._removed.append(announced)
            self.stats["removed"] += 1


class EvictionFeed:
    """Reads kvd's eviction feed into a ``KvEvents`` without ever blocking vLLM's loop.

    The feed is ``client.events(since, max)``, answering (a Pending of) ``(records, next_since,
    dropped)`` with records ``(fingerprint, salt, shard, chunk hash)``. kvd servers without it
    (before the feed landed) have clients without ``events``: then nothing is announced removed
    except on reconnection. A new client (kvd restarted or the connection was remade) means kvd's
    contents are unknown, so the tracker loses track and the feed starts over.
    """

    def __init__(self, max_records: int = 4096, interval_s: float = 0.05,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.max_records = max_records
        self.interval_s = interval_s
        self.now = now
        self._client: Any = None
        self._pending: Any = None
        self._since = 0
        self._last = float("-inf")

    def poll(self, client: Any, events: KvEvents) -> None:
        """Takes an answer that has arrived and asks again at most every ``interval_s``."""
        if client is None:
            return
        if client is not self._client:
            if self._client is not None:
                events.lost_track("reconnected")
            self._client, self._pending, self._since = client, None, 0
        feed = getattr(client, "events", None)
        if feed is None:
            return
        if self._pending is not None:
            if not self._pending.done():
                return
            pending, self._pending = self._pending, None
            try:
                records, next_since, dropped = pending.result()
            except _native.KvdError:  # a failed read is retried at the next interval
                return
            if dropped:
                events.stats["feed_dropped"] += int(dropped)
                events.lost_track("feed dropped records")
            events.removed(records)
            self._since = int(next_since)
            if len(records) >= self.max_records:
                self._last = float("-inf")  # more are waiting: read on at once
        now = self.now()
        if now - self._last >= self.interval_s:
            self._last = now
            try:
                self._pending = feed(self._since, self.max_records)
            except _native.KvdError:
                self._pending = None
