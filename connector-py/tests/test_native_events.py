"""The removal feed through the native client, against a real kvd with a small pool: evicted
chunks come back keyed as this client stored them, and a reader that falls behind the ring is
told how many records it missed."""

from __future__ import annotations

from kvd import _native

FP = 1  # the fingerprint the registration below is made under
SALT = 77


def store_all(c: _native.Client, region: int, hashes: list[int]) -> None:
    # Four chunks of two blocks fill the 8-block cache; their contents do not matter here.
    chunks = [(h, [2 * (i % 4), 2 * (i % 4) + 1]) for i, h in enumerate(hashes)]
    outcomes, _ = c.store(region, SALT, chunks).result(10)
    assert outcomes == bytes([_native.STORED] * len(hashes))


def test_evicted_chunks_reach_the_feed_and_overflow_is_counted(kvd_factory):
    from kvd.layout import describe
    from kvd.testing import vllm_cache

    # 8 MiB pool of 16 KiB pages (two 8 KiB blocks per 32-token chunk): 512 pages, FIFO.
    k = kvd_factory("--chunk-tokens", "32", "--l1-size-gb", "0.0078125", "--eviction", "fifo",
                    "--events-capacity", "64")
    c = _native.Client(k.url, "pytest-events", role="worker")
    _buf, views = vllm_cache("BLNHC", 2, 8, 2, 16, 64)
    spec = describe(views)
    reg = c.register(FP, 0, "host", spec.layer_ptrs, spec.layout)

    first = list(range(1000, 1512))
    store_all(c, reg.region, first)
    assert c.events(0, 100).result(5) == ([], 0, 0), "filling the pool evicts nothing"

    store_all(c, reg.region, list(range(5000, 5040)))
    records, next_since, dropped = c.events(0, 4096).result(5)
    assert type(records) is list and all(type(r) is tuple and len(r) == 4 for r in records)
    assert all(type(v) is int for r in records for v in r)
    assert records == [(FP, SALT, 0, h) for h in first[:40]]
    assert (next_since, dropped) == (40, 0)
    # What the feed says left kvd is what lookups no longer find.
    assert c.lookup(FP, SALT, [0], [first[39]], pin=False).result(5)[0] == 0
    assert c.lookup(FP, SALT, [0], [first[40]], pin=False).result(5)[0] == 1

    # 100 more evictions through a ring of 64: a reader left at 40 misses 36.
    store_all(c, reg.region, list(range(6000, 6100)))
    records, next_since, dropped = c.events(40, 4096).result(5)
    assert dropped == 36 and next_since == 140
    assert records == [(FP, SALT, 0, h) for h in first[76:140]]
    assert k.metric("kvd_events_dropped_total") == 36
    # From now: nothing, and the newest sequence number.
    assert c.events(2**64 - 1, 10).result(5) == ([], 140, 0)


def test_the_connectors_event_tracker_announces_what_kvds_feed_says_left(kvd_factory):
    """kvd's feed and the connector's reader together (kvd.events.EvictionFeed over a real
    client): chunks the connector announced as stored and kvd then evicted come out as removed,
    exactly those, and chunks kvd still holds stay announced."""
    from kvd.events import EventGroup, EventRequest, EvictionFeed, KvEvents
    from kvd.layout import describe
    from kvd.testing import until, vllm_cache

    k = kvd_factory("--chunk-tokens", "32", "--l1-size-gb", "0.0078125", "--eviction", "fifo")
    c = _native.Client(k.url, "pytest-events", role="worker")
    _buf, views = vllm_cache("BLNHC", 2, 8, 2, 16, 64)
    spec = describe(views)
    reg = c.register(FP, 0, "host", spec.layer_ptrs, spec.layout)
    hashes = list(range(1, 513))  # the whole 512-page pool
    store_all(c, reg.region, hashes)

    ev = KvEvents([EventGroup(FP, 16, (0,))])
    req = EventRequest(token_ids=list(range(512 * 32)), block_hashes=[[("b", i) for i in range(1024)]])
    ev.planned(req, SALT, 32, 0, [hashes])
    ev.stored([(0, SALT, 0, h) for h in hashes])
    stored = ev.take(lambda **kw: ("stored", kw), lambda **kw: ("removed", kw))
    assert len(stored) >= 1 and all(kind == "stored" for kind, _ in stored)

    store_all(c, reg.region, list(range(9000, 9030)))  # FIFO: evicts hashes 1..30
    feed = EvictionFeed(interval_s=0.0)
    removed: list[object] = []

    def poll() -> bool:
        feed.poll(c, ev)
        removed.extend(kw["block_hashes"] for kind, kw in ev.take(lambda **kw: ("stored", kw), lambda **kw: ("removed", kw))
                       if kind == "removed")
        return sum(len(b) for b in removed) >= 60

    until(poll, 5, "the removals read from kvd's feed")
    gone = [h for b in removed for h in b]
    assert sorted(gone) == sorted(("b", i) for i in range(60)), "chunks 1..30: two blocks each, nothing else"
    assert c.lookup(FP, SALT, [0], [30], pin=False).result(5)[0] == 0
    assert c.lookup(FP, SALT, [0], [31], pin=False).result(5)[0] == 1
