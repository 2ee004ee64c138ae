"""kvd.events: the chunks of kvd's tier announced to vLLM's KV event stream — the rules on plain
values (the event classes are stand-ins with vLLM's field names; tests/test_vllm_events.py uses
vLLM's own), and the eviction feed reader against a real kvd's client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvd import _native
from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.events import MEDIUM, EventGroup, EventRequest, EvictionFeed, KvEvents
from kvd.testing import until

CHUNK, BLOCK = 32, 16
FP0, FP1 = 0xA, 0xB


@dataclass
class Stored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass
class Removed:
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def request(n_tokens: int, groups: int = 1) -> EventRequest:
    # vLLM's block hashes stand-ins: ("g", group, block index).
    return EventRequest(token_ids=list(range(n_tokens)),
                        block_hashes=[[("h", g, b) for b in range(n_tokens // BLOCK)] for g in range(groups)],
                        lora_id=3, lora_name="ad")


def take(ev: KvEvents) -> list[Any]:
    return ev.take(Stored, Removed)


def test_a_chunk_is_announced_once_every_shard_holds_it_with_vllms_hashes_and_tokens():
    ev = KvEvents([EventGroup(FP0, BLOCK, shards=(0, 1))], now=Clock())
    ev.planned(request(100), salt=5, chunk_tokens=CHUNK, first_chunk=1, groups=[[0x11, 0x12]])
    assert len(ev) == 2 and take(ev) == [], "planned is not stored"
    ev.stored([(0, 5, 0, 0x11), (0, 5, 0, 0x12)])
    assert take(ev) == [], "shard 1 has not reported"
    ev.stored([(0, 5, 1, 0x11), (0, 6, 1, 0x12)])  # the second record has another salt
    (e,) = take(ev)
    assert e == Stored(block_hashes=[("h", 0, 2), ("h", 0, 3)], parent_block_hash=("h", 0, 1),
                       token_ids=list(range(32, 64)), block_size=BLOCK, lora_id=3, medium=MEDIUM,
                       lora_name="ad", group_idx=0, kv_cache_spec_kind="full_attention")
    ev.stored([(0, 5, 1, 0x11)])
    assert take(ev) == [], "announced once"


def test_the_first_chunk_has_no_parent_and_unhashed_chunks_are_not_tracked():
    ev = KvEvents([EventGroup(FP0, BLOCK, shards=(0,))], now=Clock())
    # 40 tokens: vLLM hashed blocks 0 and 1 only; the second chunk is beyond them.
    ev.planned(request(40), 0, CHUNK, 0, [[0x1, 0x2]])
    assert len(ev) == 1
    ev.stored([(0, 0, 0, 0x1), (0, 0, 0, 0x2)])
    (e,) = take(ev)
    assert e.parent_block_hash is None and e.block_hashes == [("h", 0, 0), ("h", 0, 1)]


def test_evicted_chunks_are_announced_removed_per_group_and_unannounced_ones_silently():
    groups = [EventGroup(FP0, BLOCK, (0,)), EventGroup(FP1, 32, (0,), kind="mla_attention")]
    ev = KvEvents(groups, now=Clock())
    req = EventRequest(list(range(96)), [[("a", b) for b in range(6)], [("b", b) for b in range(3)]])
    ev.planned(req, 0, CHUNK, 0, [[1, 2, 3], [1, 2, 3]])
    ev.stored([(0, 0, 0, 1), (0, 0, 0, 2), (1, 0, 0, 1)])
    stored = take(ev)
    assert [(e.group_idx, e.block_size, e.kv_cache_spec_kind) for e in stored] == [
        (0, 16, "full_attention"), (0, 16, "full_attention"), (1, 32, "mla_attention")]
    # kvd evicts chunk 1 of both groups and chunk 3 of group 0 (never reported stored).
    ev.removed([(FP0, 0, 0, 1), (FP1, 0, 0, 1), (FP0, 0, 0, 3), (0xDEAD, 0, 0, 1)])
    assert take(ev) == [Removed([("a", 0), ("a", 1)], MEDIUM, 0), Removed([("b", 0)], MEDIUM, 1)]
    ev.stored([(0, 0, 0, 3)])
    assert take(ev) == [], "a chunk evicted before its store was reported is not announced"


def test_sliding_window_and_state_groups_are_not_announced():
    groups = [EventGroup(FP0, BLOCK, (0,), kind="sliding_window", sliding_window=128),
              EventGroup(FP1, BLOCK, (0,), kind="mamba")]
    ev = KvEvents(groups, now=Clock())
    ev.planned(request(64, groups=2), 0, CHUNK, 0, [[1], [1]])
    assert len(ev) == 0


def test_stores_never_reported_expire_and_the_tracker_stays_bounded():
    clock = Clock()
    ev = KvEvents([EventGroup(FP0, BLOCK, (0,))], max_chunks=2, pending_timeout_s=10, now=clock)
    ev.planned(request(96), 0, CHUNK, 0, [[1, 2, 3]])
    assert len(ev) == 2 and ev.stats["forgotten"] == 1, "the oldest (unannounced) is forgotten"
    ev.stored([(0, 0, 0, 2)])
    assert len(take(ev)) == 1
    clock.t += 11
    assert take(ev) == [] and len(ev) == 1 and ev.stats["expired"] == 1, "chunk 3 never completed"
    # A new chunk pushes the announced chunk 2 out: it is announced removed, not silently lost.
    ev.planned(request(160), 0, CHUNK, 3, [[4, 5]])
    assert take(ev) == [Removed([("h", 0, 2), ("h", 0, 3)], MEDIUM, 0)]


def test_losing_track_announces_every_announced_chunk_removed():
    ev = KvEvents([EventGroup(FP0, BLOCK, (0,))], now=Clock())
    ev.planned(request(96), 0, CHUNK, 0, [[1, 2, 3]])
    ev.stored([(0, 0, 0, 1), (0, 0, 0, 2)])
    take(ev)
    ev.lost_track()
    assert take(ev) == [Removed([("h", 0, 0), ("h", 0, 1), ("h", 0, 2), ("h", 0, 3)], MEDIUM, 0)]
    assert len(ev) == 0 and ev.stats["resyncs"] == 1
    ev.stored([(0, 0, 0, 3)])
    assert take(ev) == []


class Done:
    """An answered ``Pending``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self.value


class FeedClient:
    """A client with the eviction feed's API (kvd's server side lands on another branch), serving
    a list of records from ``since`` on, as kvd's ring would."""

    def __init__(self, records: list[tuple[int, int, int, int]], dropped: int = 0) -> None:
        self.records, self.dropped, self.calls = records, dropped, []

    def events(self, since: int, max: int):
        self.calls.append((since, max))
        got = self.records[since:since + max]
        return Done((got, since + len(got), self.dropped if since == 0 else 0))


def announced(ev: KvEvents, n: int) -> None:
    req = request(n * CHUNK)
    ev.planned(req, 0, CHUNK, 0, [list(range(1, n + 1))])
    ev.stored([(0, 0, 0, h) for h in range(1, n + 1)])
    take(ev)


def test_the_feed_reader_announces_evictions_pages_on_and_resyncs_when_records_were_dropped():
    clock = Clock()
    ev = KvEvents([EventGroup(FP0, BLOCK, (0,))], now=clock)
    announced(ev, 3)
    client = FeedClient([(FP0, 0, 0, 1), (FP0, 0, 0, 9), (FP0, 0, 0, 2)])
    feed = EvictionFeed(max_records=2, interval_s=1.0, now=clock)
    feed.poll(client, ev)
    assert client.calls == [(0, 2)]
    feed.poll(client, ev)  # the answer: two records, a full page, so it reads on at once
    assert client.calls == [(0, 2), (2, 2)]
    assert [e.block_hashes for e in take(ev)] == [[("h", 0, 0), ("h", 0, 1)]]
    feed.poll(client, ev)
    assert [e.block_hashes for e in take(ev)] == [[("h", 0, 2), ("h", 0, 3)]]
    assert len(client.calls) == 2, "a short page: the next read waits for the interval"
    clock.t += 1
    feed.poll(client, ev)
    assert client.calls[-1] == (3, 2)

    ev2 = KvEvents([EventGroup(FP0, BLOCK, (0,))], now=clock)
    announced(ev2, 2)
    lossy = FeedClient([], dropped=5)
    feed2 = EvictionFeed(now=clock)
    feed2.poll(lossy, ev2)
    feed2.poll(lossy, ev2)
    assert len(take(ev2)) == 1 and ev2.stats["feed_dropped"] == 5 and len(ev2) == 0


def test_without_the_feed_nothing_is_removed_until_kvd_is_a_new_client(kvd_factory):
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    cfg = KvdConfig(url=k.url, connect_timeout_s=1.0, request_timeout_s=2.0, reconnect_min_s=0.1, reconnect_max_s=0.2,
                    store_deadline_s=10.0)
    conn = Connection(cfg, "sched", "scheduler")
    ev = KvEvents([EventGroup(FP0, BLOCK, (0,))])
    announced(ev, 2)
    feed = EvictionFeed()
    client = conn.client()
    assert client is not None
    feed.poll(client, ev)
    feed.poll(client, ev)
    if not hasattr(client, "events"):
        assert take(ev) == [] and len(ev) == 2
    # kvd restarts on the same port: the client is a new one, everything announced is gone.
    port = k.port
    k.stop()
    k2 = kvd_factory("--chunk-tokens", str(CHUNK), port=port)
    new = until(lambda: (lambda c: c if c is not None and c is not client else None)(conn.client()), 10, "reconnection")
    feed.poll(new, ev)
    assert [e.block_hashes for e in take(ev)] == [[("h", 0, b) for b in range(4)]]
    conn.close()
    k2.stop()
