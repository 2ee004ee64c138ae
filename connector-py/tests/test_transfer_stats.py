"""What the worker records for vLLM's offload metrics and KV events, against a real kvd: the
bytes of the blocks each store and retrieve copied, their time, refusals, and the keys of the
chunks a store put in kvd."""

from __future__ import annotations

from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.metadata import SKIP, KvdMetadata, LoadOp, StoreOp
from kvd.testing import until, vllm_cache
from kvd.worker import MAX_RECORDS, KvdWorker, WorkerGroup
from kvd import chunk_hashes

FP = 0xC0DE
CHUNK = 32  # the kvd fixture runs with --chunk-tokens 32
BLOCK = 16
PER = CHUNK // BLOCK
LAYERS, HEADS, CONTENT = 4, 2, 64
BLOCK_BYTES = HEADS * BLOCK * CONTENT * 2  # one block of one layer, bf16


def make_worker(url: str, shard: int = 0) -> KvdWorker:
    cfg = KvdConfig(url=url, chunk_tokens=CHUNK, connect_timeout_s=1.0, request_timeout_s=5.0, store_deadline_s=10.0)
    buf, views = vllm_cache("BLNHC", LAYERS, 64, HEADS, BLOCK, CONTENT)
    buf.fill_random(1)
    w = KvdWorker(cfg, Connection(cfg, "worker", "worker"), [WorkerGroup(FP, shard)])
    w.register([views])
    w._test_buf = buf  # type: ignore[attr-defined]  # keeps the memory alive
    until(lambda: all(r is not None for r in w.registrations), what="registration")
    return w


def drain(w: KvdWorker) -> None:
    until(lambda: (w.get_finished(), not w.has_pending())[1], what="copies done")


def test_a_store_and_a_load_record_the_bytes_of_the_blocks_they_copied(kvd):
    w = make_worker(kvd.url)
    w.report_stored = True
    hashes = chunk_hashes(list(range(3 * CHUNK)), CHUNK)
    chunks = [(h, list(range(c * PER, (c + 1) * PER))) for c, h in enumerate(hashes)]
    w.save(KvdMetadata(stores=[StoreOp("a", 7, [chunks])]))
    drain(w)
    t = w.take_stats()
    assert t.store_bytes == 3 * PER * BLOCK_BYTES * LAYERS
    assert t.store_sizes == [t.store_bytes] and t.store_seconds > 0
    assert (t.load_bytes, t.load_sizes, t.store_refused_chunks) == (0, [], 0)
    assert w.take_stats().is_empty(), "taking resets"
    assert w.take_stored() == [(0, 7, 0, h) for h in hashes]

    # The same chunks again: kvd has them, nothing is copied, but they are in kvd.
    w.save(KvdMetadata(stores=[StoreOp("a2", 7, [chunks])]))
    drain(w)
    assert w.take_stats().is_empty()
    assert w.take_stored() == [(0, 7, 0, h) for h in hashes]

    # A load of two chunks into other blocks, the first block of the first chunk kept local.
    dest = [(hashes[0], [SKIP, 41]), (hashes[1], [42, 43])]
    w.start_load(KvdMetadata(loads=[LoadOp("b", 7, [([0], dest)])]))
    drain(w)
    assert w.failed_loads() == set()
    t = w.take_stats()
    assert t.load_bytes == 3 * BLOCK_BYTES * LAYERS, "the skipped block is not counted"
    assert t.load_sizes == [t.load_bytes] and t.load_seconds > 0 and t.store_sizes == []
    w.shutdown()


def test_stored_keys_are_only_collected_when_asked_for_and_stay_bounded(kvd):
    w = make_worker(kvd.url, shard=0)
    hashes = chunk_hashes(list(range(2 * CHUNK)), CHUNK)
    chunks = [(h, list(range(c * PER, (c + 1) * PER))) for c, h in enumerate(hashes)]
    w.save(KvdMetadata(stores=[StoreOp("a", 0, [chunks])]))
    drain(w)
    assert w.take_stored() == [], "report_stored is off by default"
    assert w.take_stats().store_sizes, "the stats are recorded regardless"

    # Nobody takes the stats: the per-transfer sizes stop growing at MAX_RECORDS.
    t = w._transfers
    t.store_sizes.extend([1] * (MAX_RECORDS - len(t.store_sizes)))
    w.save(KvdMetadata(stores=[StoreOp("b", 1, [chunks])]))
    drain(w)
    t = w.take_stats()
    assert len(t.store_sizes) == MAX_RECORDS and t.dropped_sizes == 1
    w.shutdown()
