"""The scheduler-side and worker-side objects against a real kvd, with host memory shaped like
vLLM's KV cache: store, prefix lookup, asynchronous load into other blocks, failure paths and
reconnection — every byte checked."""

from __future__ import annotations

import time

import pytest

from kvd import _native
from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.keys import Span
from kvd.metadata import SKIP, KvdMetadata, LoadOp
from kvd.scheduler import GroupInfo, KvdScheduler, SchedRequest
from kvd.testing import blocks_bytes, until, vllm_cache
from kvd.worker import KvdWorker, WorkerGroup

FP = 0xC0DE
CHUNK = 32  # the kvd fixture runs with --chunk-tokens 32
BLOCK = 16
PER = CHUNK // BLOCK


def config(url: str, **kw) -> KvdConfig:
    # Stores get 10 s to start (2 s by default): these tests count hits, and a loaded CI machine
    # can hold a debug kvd past 2 s, when a store expires and its hit is lost (the deadline's
    # own tests set it short).
    kw.setdefault("store_deadline_s", 10.0)
    # Most tests here walk the asynchronous load protocol; the synchronous one has its own.
    kw.setdefault("load_mode", "async")
    return KvdConfig(url=url, chunk_tokens=CHUNK, connect_timeout_s=1.0, request_timeout_s=5.0,
                     reconnect_min_s=0.1, reconnect_max_s=0.5, **kw)


class Rig:
    """One rank (worker over a host KV cache) and the scheduler, both talking to kvd."""

    def __init__(self, url: str, order: str = "BLNHC", blocks: int = 64, **kw) -> None:
        self.cfg = config(url, **kw)
        self.buf, self.views = vllm_cache(order, 4, blocks, 2, BLOCK, 64)
        self.buf.fill_random(1)
        self.worker = KvdWorker(self.cfg, Connection(self.cfg, "worker", "worker"), [WorkerGroup(FP, 0)])
        self.worker.register([self.views])
        self.sched = KvdScheduler(self.cfg, [GroupInfo(FP, BLOCK, (0,), 1)], Connection(self.cfg, "sched", "scheduler"))

    def lookup(self, req: SchedRequest, computed: int):
        return until(lambda: (lambda r: r if r[0] is not None else None)(self.sched.get_num_new_matched_tokens(req, computed)))

    def run_prefill(self, req: SchedRequest, blocks: list[int]) -> KvdMetadata:
        """vLLM computes the whole prompt in one step, then the worker stores."""
        self.sched.update_state_after_alloc(req.req_id, [blocks], 0)
        meta = self.sched.build([(req, 0, len(req.token_ids), [blocks])])
        self.worker.save(meta)
        until(lambda: self.worker.get_finished() is not None and not self.worker.has_pending())
        return meta

    def finish(self, req_id: str) -> set[str]:
        delayed = self.sched.request_finished(req_id)
        self.worker.save(self.sched.build([]))
        sent = until(lambda: self.worker.get_finished()[0] or (set() if not delayed else None), 5) if delayed else set()
        return sent


def req(req_id: str, tokens: list[int], **kw) -> SchedRequest:
    return SchedRequest(req_id=req_id, token_ids=tokens, num_prompt_tokens=len(tokens), **kw)


@pytest.mark.parametrize("order", ["BLNHC", "LBNHC", "LHBNC"])
def test_store_then_a_shared_prefix_loads_bit_exact_into_other_blocks(kvd, order):
    rig = Rig(kvd.url, order)
    a = req("a", list(range(200)))
    assert rig.lookup(a, 0) == (0, False)
    blocks_a = list(range(1, 14))  # block 0 is vLLM's null block
    meta = rig.run_prefill(a, blocks_a)
    assert [len(op.groups[0]) for op in meta.stores] == [6], "six full 32-token chunks of 200 tokens"
    assert rig.finish("a") == {"a"}, "the delayed free is reported once the stores are done"
    expected = blocks_bytes(rig.views, blocks_a[:8])

    # B shares 150 tokens (four whole chunks); vLLM already holds its first block locally.
    b = req("b", list(range(150)) + [999] * 60)
    assert rig.lookup(b, BLOCK) == (4 * CHUNK - BLOCK, True)
    blocks_b = list(range(20, 34))
    before = blocks_bytes(rig.views, [blocks_b[0]])
    rig.sched.update_state_after_alloc("b", [blocks_b], 4 * CHUNK - BLOCK)
    meta = rig.sched.build([])
    assert len(meta.loads) == 1 and meta.loads[0].groups[0][1][0][1][0] == SKIP
    rig.worker.start_load(meta)
    _, recving = until(lambda: (lambda f: f if f[1] else None)(rig.worker.get_finished()))
    assert recving == {"b"}
    assert rig.worker.load_errors() == set() and rig.worker.failed_loads() == set()
    got = blocks_bytes(rig.views, blocks_b[1:8])
    assert got == expected[1:8], "loaded blocks hold exactly what was stored"
    assert blocks_bytes(rig.views, [blocks_b[0]]) == before, "the locally computed block was left alone"
    assert kvd.metric("kvd_lookup_pins") == 0, "the load released the lookup's pin"


def test_a_load_waits_for_the_model_stream_only_where_a_running_pass_may_use_its_blocks(kvd):
    # Under vLLM's asynchronous scheduling a forward pass still runs while the next step is
    # planned, and it may use blocks freed between the two (a request that ended in the step
    # before was already planned into it) or by a preemption. A load into such a block must
    # wait for the model's stream (an event kvd's copy waits on); any other load starts at once.
    rig = Rig(kvd.url)
    a = req("a", list(range(100)))
    rig.lookup(a, 0)
    blocks_a = list(range(1, 8))
    rig.run_prefill(a, blocks_a)
    expected = blocks_bytes(rig.views, blocks_a[:6])
    rig.sched.blocks_freed([blocks_a])  # what the vLLM adapter reports from request_finished
    rig.finish("a")  # one scheduling pass

    def load(req_id: str, blocks: list[int], preempted: tuple[str, ...] = (), written: set[int] | None = set()) -> LoadOp:
        r = req(req_id, list(range(100)))
        assert rig.lookup(r, 0) == (3 * CHUNK, True)
        rig.sched.update_state_after_alloc(req_id, [blocks], 3 * CHUNK)
        (op,) = rig.sched.build([], preempted, written).loads
        rig.worker.start_load(KvdMetadata(loads=[op]))
        until(lambda: rig.worker.get_finished()[1] == {req_id})
        assert rig.worker.failed_loads() == set()
        assert blocks_bytes(rig.views, blocks[:6]) == expected, "the load moved the stored bytes"
        return op

    # The pass after a's blocks were freed is the margin: a load into one of them still waits.
    assert load("b", [40, 41, 42, 43, 44, 7]).wait
    # Two passes on, and into blocks nobody freed, loads start at once.
    assert not load("c", [3, 4, 5, 6, 45, 46]).wait
    assert not load("d", [50, 51, 52, 53, 54, 55]).wait
    assert rig.sched.stats["loads_overlapped"] == 2
    # A preemption frees blocks this side does not see: every load of that pass and the next waits.
    assert load("e", [20, 21, 22, 23, 24, 25], preempted=("x",)).wait
    assert load("f", [26, 27, 28, 29, 30, 31]).wait
    assert not load("g", [32, 33, 34, 35, 36, 37]).wait
    # A block vLLM writes on the model's stream before the forward pass (it zeroes new blocks of
    # Mamba models; a copy-on-write copy) must get vLLM's write first; so must every block when
    # the adapter cannot read vLLM's copies (None).
    assert load("h", [56, 57, 58, 59, 60, 61], written={59}).wait
    assert not load("i", [8, 9, 10, 11, 12, 13], written={59}).wait
    assert load("j", [14, 15, 16, 17, 18, 19], written=None).wait

    # Off, or in a model whose blocks leave running requests (a sliding window), every load waits.
    off = KvdScheduler(config(kvd.url, load_overlap=False), [GroupInfo(FP, BLOCK, (0,), 1)], None)
    swa = KvdScheduler(config(kvd.url), [GroupInfo(FP, BLOCK, (0,), 1), GroupInfo(FP + 1, BLOCK, (0,), 1, sliding=True, window=64)], None)
    assert rig.sched.overlap_loads and not off.overlap_loads and not swa.overlap_loads


def test_salts_images_and_adapters_separate_keys(kvd):
    rig = Rig(kvd.url)
    toks = list(range(100))
    a = req("a", toks, salt=5, spans=[Span(40, 20, b"img-1")])
    rig.lookup(a, 0)
    rig.run_prefill(a, list(range(1, 8)))
    rig.finish("a")
    assert rig.lookup(req("same", toks, salt=5, spans=[Span(40, 20, b"img-1")]), 0)[0] == 3 * CHUNK
    assert rig.lookup(req("other-salt", toks, salt=6, spans=[Span(40, 20, b"img-1")]), 0) == (0, False)
    assert rig.lookup(req("other-image", toks, salt=5, spans=[Span(40, 20, b"img-2")]), 0)[0] == CHUNK, "chunks before the image still hit"
    assert rig.lookup(req("lora", toks, salt=5, spans=[Span(40, 20, b"img-1")], namespace=("adapter", "/x")), 0) == (0, False)


def test_a_missing_chunk_is_a_load_error_not_a_crash(kvd):
    rig = Rig(kvd.url)
    meta = KvdMetadata(loads=[LoadOp("ghost", 0, [([0], [(12345, [40, 41]), (67890, [SKIP, 43])])])])
    rig.worker.start_load(meta)
    _, recving = until(lambda: (lambda f: f if f[1] else None)(rig.worker.get_finished()))
    assert recving == {"ghost"}
    assert rig.worker.load_errors() == {40, 41, 43}
    assert rig.worker.failed_loads() == {"ghost"}


def test_pins_unused_by_vllm_are_released(kvd):
    rig = Rig(kvd.url)
    a = req("a", list(range(100)))
    rig.lookup(a, 0)
    rig.run_prefill(a, list(range(1, 8)))
    rig.finish("a")
    b = req("b", list(range(100)))
    assert rig.lookup(b, 0)[0] == 3 * CHUNK
    assert kvd.metric("kvd_lookup_pins") == 1
    rig.sched.update_state_after_alloc("b", [list(range(10, 17))], 0)  # vLLM took none of it
    until(lambda: kvd.metric("kvd_lookup_pins") == 0)


def test_a_registration_kvd_is_not_ready_for_is_retried(kvd_factory, caplog):
    import json
    import urllib.error
    import urllib.request

    # A 3 GiB pool first-touched by one thread takes seconds: kvd answers NotReady meanwhile.
    k = kvd_factory("--chunk-tokens", "32", "--l1-size-gb", "3", "--populate-threads", "1", wait_ready=False)
    caplog.set_level("INFO", logger="kvd")
    rig = Rig(k.url)
    try:
        urllib.request.urlopen(f"http://{k.http}/healthz", timeout=5)
        pytest.fail("kvd was ready already; this test needs it populating")
    except urllib.error.HTTPError as e:
        assert e.code == 503 and json.loads(e.read())["status"] in ("starting", "populating")
    until(lambda: all(r is not None for r in rig.worker.registrations), 60)
    assert "not ready for the registration yet" in caplog.text
    assert k.metric("kvd_registered_workers") == 1
    # Each refusal is an error reply, counted under its own code (docs/operations.md: an alert
    # on error replies leaves this code out).
    refused = k.metric('kvd_request_errors_total{code="NotReady",op="register"}')
    assert refused >= 1
    assert k.metric("kvd_request_errors_total") == refused


def test_kvd_down_is_a_miss_and_the_connector_recovers_when_it_returns(kvd_factory, tmp_path):
    k = kvd_factory("--chunk-tokens", "32")
    port, fd = k.port, k.fd_socket
    rig = Rig(k.url)
    a = req("a", list(range(100)))
    rig.lookup(a, 0)
    rig.run_prefill(a, list(range(1, 8)))
    k.stop()

    # While kvd is gone: lookups miss at once, loads fail into recompute, nothing raises.
    t = time.monotonic()
    until(lambda: rig.sched.get_num_new_matched_tokens(req("b", list(range(100))), 0) == (0, False))
    assert time.monotonic() - t < 2
    rig.worker.start_load(KvdMetadata(loads=[LoadOp("c", 0, [([0], [(1, [50, 51])])])]))
    until(lambda: rig.worker.get_finished()[1] == {"c"})
    assert rig.worker.load_errors() == {50, 51}
    assert rig.sched.build([(req("d", list(range(64))), 0, 64, [[1, 2, 3, 4]])]).stores == []

    # kvd returns (empty); the worker registers again and the cache fills again.
    k2 = kvd_factory("--chunk-tokens", "32", port=port, fd_socket=fd)
    until(lambda: rig.worker.conn.connects >= 2 and rig.sched.conn.client() is not None, 10)
    until(lambda: all(r is not None for r in rig.worker.registrations))
    e = req("e", list(range(100)))
    assert rig.lookup(e, 0) == (0, False)
    rig.run_prefill(e, list(range(1, 8)))
    rig.finish("e")
    assert rig.lookup(req("f", list(range(100))), 0)[0] == 3 * CHUNK
    assert k2.metric("kvd_registered_workers") == 1


def test_lookups_behind_one_that_waits_pin_nothing_until_a_later_pass(kvd):
    # vLLM goes on to the next waiting request when one answers "ask again" (a lookup waiting
    # for kvd's disk); pinning every request behind it gave the pool to requests that may wait
    # long (the H200 replay with a disk tier: 428,527 chunks over the pin share against 400).
    import os
    import signal

    # (Without the presence filter, which answers x's lookup, a prompt kvd never saw, without
    # kvd: test_a_lookup_kvd_certainly_cannot_serve_is_answered_without_waiting.)
    rig = Rig(kvd.url, presence=False)
    a = req("a", list(range(100)))
    rig.lookup(a, 0)
    rig.run_prefill(a, list(range(1, 8)))
    rig.finish("a")
    until(lambda: rig.sched.conn.client() is not None)
    before = rig.sched.lookup_totals()
    # kvd is held up: the first request's lookup is still under way when the call returns.
    kvd.sigstop()
    try:
        assert rig.sched.get_num_new_matched_tokens(req("x", list(range(5000, 5100))), 0) == (None, False)
        b = req("b", list(range(100)))
        assert rig.sched.get_num_new_matched_tokens(b, 0) == (None, False)
        # What vLLM's metrics count (vllm:kvd_lookups, vllm:kvd_lookup_waits): two lookups
        # sent, both answered "ask again".
        totals = rig.sched.lookup_totals()
        assert {k: totals[k] - before[k] for k in totals} == {"lookups": 2, "lookups_unwaited": 0, "lookup_waits": 2,
                                                              "lookup_timeouts": 0}
    finally:
        os.kill(kvd.proc.pid, signal.SIGCONT)
    # In the same pass, b's answer is a hit that pinned nothing.
    assert until(lambda: rig.sched.get_num_new_matched_tokens(b, 0)[0]) == 3 * CHUNK
    assert kvd.metric("kvd_lookup_pins") == 0
    # The next pass asks again, pinned.
    rig.sched.build([])
    assert rig.lookup(b, 0) == (3 * CHUNK, True)
    assert kvd.metric("kvd_lookup_pins") == 1


def test_a_lookup_kvd_certainly_cannot_serve_is_answered_without_waiting(kvd):
    # kvd's presence filter (a shared-memory file kvd names in its hello) says which chunks kvd
    # certainly lacks. A lookup whose first chunk beyond vLLM's own prefix cache is one of them
    # is answered "nothing to load" at once, even with kvd stopped, and still reaches kvd.
    import os
    import signal

    rig = Rig(kvd.url)
    client = until(lambda: rig.sched.conn.client())
    assert client.presence and client.presence.startswith("/dev/shm/kvd-presence-") and os.path.exists(client.presence)
    assert client.server["presence"] == client.presence and client.presence_error is None
    a = req("a", list(range(100)))
    rig.lookup(a, 0)
    rig.run_prefill(a, list(range(1, 8)))
    rig.finish("a")
    before = rig.sched.lookup_totals()
    asked = kvd.metric("kvd_lookups_total")
    kvd.sigstop()
    try:
        t = time.monotonic()
        # A prompt kvd never saw.
        assert rig.sched.get_num_new_matched_tokens(req("n", list(range(5000, 5100))), 0) == (0, False)
        # a's three chunks and a new tail, the three chunks in vLLM's own cache: kvd could only
        # add the fourth, which it certainly lacks.
        c = req("c", list(range(96)) + list(range(9000, 9050)))
        assert rig.sched.get_num_new_matched_tokens(c, 3 * CHUNK) == (0, False)
        assert time.monotonic() - t < 0.5, "answered without kvd"
        totals = rig.sched.lookup_totals()
        assert {k: totals[k] - before[k] for k in totals} == {"lookups": 2, "lookups_unwaited": 2, "lookup_waits": 0,
                                                              "lookup_timeouts": 0}
        # What kvd may hold still waits for kvd.
        assert rig.sched.get_num_new_matched_tokens(req("b", list(range(100))), 0) == (None, False)
    finally:
        os.kill(kvd.proc.pid, signal.SIGCONT)
    # kvd heard of both unwaited lookups (and b's).
    until(lambda: kvd.metric("kvd_lookups_total") == asked + 3 or None)
    # c's store names every chunk (kvd holds the first three and copies only the fourth), so
    # that the whole prompt hits afterwards.
    blocks = list(range(10, 20))
    rig.sched.update_state_after_alloc("c", [blocks], 0)
    meta = rig.sched.build([(c, 3 * CHUNK, len(c.token_ids) - 3 * CHUNK, [blocks])])
    assert [len(g) for g in meta.stores[0].groups] == [4]
    stored = rig.worker.stats["stored_chunks"]
    rig.worker.save(meta)
    until(lambda: rig.worker.get_finished() is not None and not rig.worker.has_pending())
    assert rig.worker.stats["stored_chunks"] == stored + 1, "kvd copied the fourth chunk alone"
    rig.finish("c")
    assert rig.lookup(req("d", list(range(96)) + list(range(9000, 9050))), 0) == (4 * CHUNK, True)


def test_without_a_presence_filter_every_lookup_asks_kvd(tmp_path):
    import os
    import signal

    from conftest import Kvd

    k = Kvd(tmp_path, "--chunk-tokens", "32", "--presence-dir", "off")
    try:
        rig = Rig(k.url)
        client = until(lambda: rig.sched.conn.client())
        assert client.presence is None and client.server["presence"] == ""
        assert client.first_absent(FP, 0, 0, [1, 2]) is None
        k.sigstop()
        try:
            assert rig.sched.get_num_new_matched_tokens(req("n", list(range(5000, 5100))), 0) == (None, False)
        finally:
            os.kill(k.proc.pid, signal.SIGCONT)
        # Nor is one used with kvd's filter switched off in the connector.
        off_rig = Rig(k.url, presence=False)
        assert until(lambda: off_rig.sched.get_num_new_matched_tokens(req("m", list(range(7000, 7100))), 0)[0] is not None or None)
        assert off_rig.sched.stats["lookups_unwaited"] == 0
    finally:
        k.stop()


def test_a_filter_this_process_cannot_read_is_logged_and_lookups_wait_for_kvd(tmp_path, caplog):
    # As for vLLM in a container that does not share kvd's /dev/shm: kvd names a file that is
    # not there for this process.
    import logging
    import os

    from conftest import Kvd

    shm = tmp_path / "shm"
    shm.mkdir()
    k = Kvd(tmp_path, "--chunk-tokens", "32", "--presence-dir", str(shm))
    try:
        (named,) = os.listdir(shm)
        assert named.startswith("kvd-presence-")
        os.unlink(shm / named)
        with caplog.at_level(logging.INFO, logger="kvd"):
            rig = Rig(k.url)
            client = until(lambda: rig.sched.conn.client())
        assert client.presence is None and named in (client.presence_error or "")
        assert any("cannot read kvd's presence filter" in r.getMessage() for r in caplog.records)
        k.sigstop()
        try:
            assert rig.sched.get_num_new_matched_tokens(req("n", list(range(5000, 5100))), 0) == (None, False)
        finally:
            import signal
            os.kill(k.proc.pid, signal.SIGCONT)
    finally:
        k.stop()


def test_unread_lookups_are_bounded_while_kvd_does_not_answer(kvd):
    # They only teach kvd; a kvd that keeps the connection and stops answering must not grow
    # the client: past 64 unanswered, they are not sent, and sending resumes once kvd answers.
    import os
    import signal

    c = _native.Client(kvd.url, "t", role="scheduler")
    kvd.sigstop()
    try:
        sent = [c.lookup_unread(FP, 0, [0], [i]) for i in range(100)]
    finally:
        os.kill(kvd.proc.pid, signal.SIGCONT)
    assert sent == [True] * 64 + [False] * 36
    assert until(lambda: c.lookup_unread(FP, 0, [0], [7]) or None)
    until(lambda: kvd.metric("kvd_lookups_total") >= 65 or None)


def test_kvd_removes_its_presence_filter_when_it_exits(tmp_path):
    import os

    from conftest import Kvd

    k = Kvd(tmp_path, "--chunk-tokens", "32")
    c = _native.Client(k.url, "t", role="tool")
    path = c.presence
    assert path and os.path.exists(path)
    assert c.first_absent(FP, 0, 0, [1, 2, 3]) == 0
    assert k.stop() == 0
    assert not os.path.exists(path)
    # A client that still has it mapped no longer trusts it.
    assert c.first_absent(FP, 0, 0, [1, 2, 3]) == 3


def test_lookup_never_blocks_the_scheduler(kvd):
    rig = Rig(kvd.url)
    until(lambda: rig.sched.conn.client() is not None)
    t = time.monotonic()
    first = rig.sched.get_num_new_matched_tokens(req("a", list(range(4000))), 0)
    # Either the lookup is still under way ("ask again"), or kvd answered (a miss) before the
    # call returned; either way the call does not wait for kvd.
    assert first in ((None, False), (0, False))
    assert time.monotonic() - t < 0.05


def test_an_answer_for_other_computed_tokens_is_not_replayed(kvd):
    # Found by the agentic replay: vLLM asks again with fewer locally computed tokens (its prefix
    # cache lost a block before it could allocate); the answer must be for the new count, or the
    # load plan covers other tokens than vLLM allocated blocks for.
    rig = Rig(kvd.url)
    a = req("a", list(range(200)))
    rig.lookup(a, 0)
    rig.run_prefill(a, list(range(1, 14)))
    rig.finish("a")
    b = req("b", list(range(200)))
    assert rig.lookup(b, 2 * BLOCK) == (6 * CHUNK - 2 * BLOCK, True)
    assert rig.sched.get_num_new_matched_tokens(b, BLOCK) in ((None, False), (6 * CHUNK - BLOCK, True))
    assert rig.lookup(b, BLOCK) == (6 * CHUNK - BLOCK, True)
    rig.sched.update_state_after_alloc("b", [list(range(20, 33))], 6 * CHUNK - BLOCK)
    (op,) = rig.sched.build([]).loads
    assert [len(blocks) for _, blocks in op.groups[0][1]] == [PER] * 6
    assert op.groups[0][1][0][1] == [SKIP, 21], "the load starts after the one block vLLM holds"


def _host_layer(blocks: int, rows: int, content: int):
    from kvd.testing import HostView

    buf = _native.HostBuffer(blocks * rows * content)
    return HostView(buf, 0, (blocks, 1, rows, content), (rows * content, rows * content, content, 1), 1)


def _rows(view, block: int) -> bytes:
    page = view.strides[0]
    return view.buffer.read(block * page, page)


def test_mixed_shape_compressed_and_sliding_groups_round_trip(kvd):
    """DeepSeek-V4's shapes at the kvd fixture's 32-token chunks: group 0 holds layers of three
    shapes in 32-token blocks (8 rows of 4 tokens, 8 rows of 4 tokens at another width, and one
    32-token state); group 1 is a sliding window of 16-token blocks, window 16. Each shape is its
    own registration; a hit needs every registration. The window fits in a chunk, so group 1's
    entry is each chunk's last block, all a hit ending there reads."""
    g0 = [_host_layer(16, 8, 72), _host_layer(16, 8, 20), _host_layer(16, 1, 72)]
    g1 = [_host_layer(32, 16, 72), _host_layer(32, 16, 72)]
    for i, v in enumerate(g0 + g1):
        v.buffer.fill_random(10 + i)
        v.buffer.write(0, bytes(v.strides[0]))  # the null block stays zero
    cfg = config(kvd.url)
    worker = KvdWorker(cfg, Connection(cfg, "w", "worker"), [
        WorkerGroup(FP, 0, block_tokens=32), WorkerGroup(FP + 1, 0, sliding=True, block_tokens=16, window=16)])
    worker.register([g0, g1])
    until(lambda: all(r is not None for r in worker.registrations))
    assert worker.subs == [3, 1]
    assert [r.chunk_blocks for r in worker.registrations] == [1, 1, 1, 1], (
        "a chunk is one 32-token block of group 0, and the last of its two 16-token blocks in group 1")
    sched = KvdScheduler(cfg, [GroupInfo(FP, 32, (0,), 1), GroupInfo(FP + 1, 16, (0,), 1, sliding=True, window=16)],
                         Connection(cfg, "s", "scheduler"))
    a = req("a", list(range(1000, 1100)))  # three whole chunks
    until(lambda: sched.get_num_new_matched_tokens(a, 0)[0] is not None)
    blocks_a = [[1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7]]
    sched.update_state_after_alloc("a", blocks_a, 0)
    meta = sched.build([(a, 0, 100, blocks_a)])
    worker.save(meta)
    until(lambda: worker.get_finished() is not None and not worker.has_pending())
    assert worker.stats["stored_chunks"] == 3 * 4
    want0 = [[_rows(v, b) for b in blocks_a[0][:3]] for v in g0]
    want1 = [[_rows(v, b) for b in (5, 6)] for v in g1]

    # Before the workers said how many registrations group 0 has, its key is another: no hit.
    b = req("b", list(range(1000, 1100)))
    assert until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(b, 0))) == (0, False)
    sched.update_state_after_alloc("b", [[9], [9]], 0)
    sched.set_subs(worker.subs)
    c = req("c", list(range(1000, 1100)))
    assert until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(c, 0))) == (3 * CHUNK, True)
    # vLLM keeps only the window's blocks of group 1: the 16 tokens before token 96.
    blocks_c = [[10, 11, 12, 13], [0, 0, 0, 0, 0, 20, 21]]
    sched.update_state_after_alloc("c", blocks_c, 3 * CHUNK)
    meta = sched.build([])
    (op,) = meta.loads
    assert [len(pins) for pins, _ in op.groups] == [3, 1], "one pin per registration"
    assert [blocks for _, blocks in op.groups[1][1]] == [[20]], "the window's one block, and nothing of the null blocks"
    worker.start_load(meta)
    _, recving = until(lambda: (lambda f: f if f[1] else None)(worker.get_finished()))
    assert recving == {"c"} and worker.failed_loads() == set() and worker.load_errors() == set()
    assert [[_rows(v, b) for b in (10, 11, 12)] for v in g0] == want0
    assert [[_rows(v, 20)] for v in g1] == [[w[1]] for w in want1], "the window's block holds what was stored"
    assert all(_rows(v, 0) == bytes(v.strides[0]) for v in g0 + g1), "the null block was never written"
    assert kvd.metric("kvd_lookup_pins") == 0


def test_r_swa_stores_only_chunks_of_the_step_and_never_the_null_block(kvd):
    """R-SWA (a sliding group with no window: vLLM frees a gap of generated blocks, not a
    window's head) stores only chunks computed wholly in the step."""
    cfg = config(kvd.url)
    sched = KvdScheduler(cfg, [GroupInfo(FP, BLOCK, (0,), 1), GroupInfo(FP + 1, BLOCK, (0,), 1, sliding=True)],
                         Connection(cfg, "s", "scheduler"))
    until(lambda: sched.conn.client() is not None)
    a = req("a", list(range(200)))
    blocks = [list(range(1, 14)), list(range(20, 33))]
    # The step computes tokens 100..199: chunks 3, 4 and 5 complete; chunk 3 began earlier.
    meta = sched.build([(a, 100, 100, blocks)])
    (op,) = meta.stores
    assert [h for h, _ in op.groups[0]] == sched._reqs["a"].hasher.known(6), "full attention: all six chunks"
    assert len(op.groups[1]) == 2, "sliding window: only chunks 4 and 5, computed wholly in this step"
    blocks[0][0] = 0
    b = req("b", list(range(500, 700)))
    (op,) = sched.build([(b, 0, 200, blocks)]).stores
    assert len(op.groups[0]) == 5, "no chunk is stored from the null block"


def test_a_sliding_group_stores_what_vllm_still_holds_and_a_hit_needs_only_its_window(kvd):
    """Window 64 tokens in 16-token blocks (vLLM keeps the 4 blocks before a boundary: two
    32-token chunks). A request whose first 192 tokens vLLM found in its own cache (kvd had
    restarted, say) stores every full-attention chunk late, and in the window group only the
    chunks whose blocks vLLM still holds: those of the window before token 192, chunks 4 and 5,
    then the chunks it computes. A later request's hit of 8 chunks is loadable: its window needs
    chunks 6 and 7 only, though the window group holds nothing before chunk 4."""
    cfg = config(kvd.url)
    infos = [GroupInfo(FP, BLOCK, (0,), 1), GroupInfo(FP + 1, BLOCK, (0,), 1, sliding=True, window=64)]
    sched = KvdScheduler(cfg, infos, Connection(cfg, "s", "scheduler"))
    worker = KvdWorker(cfg, Connection(cfg, "w", "worker"), [WorkerGroup(FP, 0, block_tokens=BLOCK),
                                                             WorkerGroup(FP + 1, 0, sliding=True, block_tokens=BLOCK, window=64)])
    g0, g1 = [_host_layer(40, BLOCK, 8)], [_host_layer(40, BLOCK, 8)]
    for i, v in enumerate(g0 + g1):
        v.buffer.fill_random(30 + i)
        v.buffer.write(0, bytes(v.strides[0]))
    worker.register([g0, g1])
    until(lambda: all(r is not None for r in worker.registrations))
    assert [r.chunk_blocks for r in worker.registrations] == [2, 2], "a window wider than a chunk keeps whole chunks"
    toks = list(range(3000, 3257))  # 8 whole chunks and a token
    a = req("a", toks)
    assert until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(a, 192))) == (0, False)
    # vLLM's local hit of 192 tokens: in the window group, blocks before (192 - 63) // 16 = 8
    # are null; the step computes tokens 192..256.
    blocks_a = [list(range(1, 18)), [0] * 8 + list(range(20, 29))]
    sched.update_state_after_alloc("a", blocks_a, 0)
    meta = sched.build([(a, 192, 65, blocks_a)])
    (op,) = meta.stores
    hashes = sched._reqs["a"].hasher.known(8)
    assert [h for h, _ in op.groups[0]] == hashes, "full attention: every chunk, the late ones too"
    assert [h for h, _ in op.groups[1]] == hashes[4:], "the window group: chunks 4 and 5 late, 6 and 7 computed"
    assert all(0 not in bs for _, bs in op.groups[1])
    worker.save(meta)
    until(lambda: worker.get_finished() is not None and not worker.has_pending())
    want = [_rows(v, b) for v in g1 for b in blocks_a[1][12:16]]
    for v in g0 + g1:
        v.buffer.fill_random(99)
        v.buffer.write(0, bytes(v.strides[0]))

    b = req("b", toks)
    hit = until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(b, 0)))
    assert hit == (8 * CHUNK, True), "a hit needs only the window's chunks in the window group"
    blocks_b = [list(range(1, 18)), [0] * 12 + [30, 31, 32, 33, 34]]
    sched.update_state_after_alloc("b", blocks_b, 8 * CHUNK)
    meta = sched.build([])
    (op,) = meta.loads
    assert [blocks for _, blocks in op.groups[1][1]] == [[30, 31], [32, 33]], "chunks 6 and 7: the window's blocks"
    worker.start_load(meta)
    _, recving = until(lambda: (lambda f: f if f[1] else None)(worker.get_finished()))
    assert recving == {"b"} and worker.failed_loads() == set() and worker.load_errors() == set()
    assert [_rows(v, b) for v in g1 for b in (30, 31, 32, 33)] == want
    assert all(_rows(v, 0) == bytes(v.strides[0]) for v in g0 + g1), "the null block was never written"


def test_a_sliding_hit_stops_at_a_chunk_missing_from_its_window(kvd):
    """The window group holds chunks 0..3 and 6..7 of a prompt, the full group all 8: a hit of 8
    chunks needs 6 and 7 (held), but a prompt of 6 chunks would need 4 and 5 (not held). The
    first gets 8 chunks; the second gets 4, the longest whose window is held."""
    cfg = config(kvd.url)
    infos = [GroupInfo(FP, BLOCK, (0,), 1), GroupInfo(FP + 1, BLOCK, (0,), 1, sliding=True, window=64)]
    sched = KvdScheduler(cfg, infos, Connection(cfg, "s", "scheduler"))
    worker = KvdWorker(cfg, Connection(cfg, "w", "worker"), [WorkerGroup(FP, 0, block_tokens=BLOCK),
                                                             WorkerGroup(FP + 1, 0, sliding=True, block_tokens=BLOCK, window=64)])
    worker.register([[_host_layer(40, BLOCK, 8)], [_host_layer(40, BLOCK, 8)]])
    until(lambda: all(r is not None for r in worker.registrations))
    toks = list(range(4000, 4257))
    a = req("a", toks)
    until(lambda: sched.get_num_new_matched_tokens(a, 0)[0] is not None)
    blocks_a = [list(range(1, 18)), list(range(1, 18))]
    sched.update_state_after_alloc("a", blocks_a, 0)
    (op,) = sched.build([(a, 0, 257, blocks_a)]).stores
    op.groups[1] = op.groups[1][:4] + op.groups[1][6:]
    worker.save(KvdMetadata(stores=[op]))
    until(lambda: worker.get_finished() is not None and not worker.has_pending())
    assert worker.stats["stored_chunks"] == 8 + 6
    b = req("b", toks)
    assert until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(b, 0))) == (8 * CHUNK, True)
    sched.update_state_after_alloc("b", [[], []], 0)
    c = req("c", toks[: 6 * CHUNK + 1])
    assert until(lambda: (lambda r: r if r[0] is not None else None)(sched.get_num_new_matched_tokens(c, 0))) == (4 * CHUNK, True)
    sched.update_state_after_alloc("c", [[], []], 0)
    until(lambda: kvd.metric("kvd_lookup_pins") == 0)


def test_a_failed_part_of_a_load_is_a_miss_once_and_what_came_before_it_hits(kvd):
    """A load's chunks 4 and 5 fail (a copy of one group can fail while the others arrive; the
    workers name the chunks). vLLM recomputes them and asks again: that lookup offers chunks 0-3
    only, so a failure that would recur cannot loop the request (vllm-project/vllm#55297); the
    one after it, a preemption later, offers all six again."""
    rig = Rig(kvd.url)
    toks = list(range(200))
    a = req("a", toks)
    rig.lookup(a, 0)
    rig.run_prefill(a, list(range(1, 14)))
    rig.finish("a")

    def load(r: SchedRequest, tokens: int, blocks: list[int]) -> None:
        rig.sched.update_state_after_alloc(r.req_id, [blocks], tokens)
        meta = rig.sched.build([])
        assert [len(op.groups[0][1]) for op in meta.loads] == [tokens // CHUNK]
        rig.worker.start_load(meta)
        until(lambda: r.req_id in rig.worker.get_finished()[1])
        assert rig.worker.failed_loads() == set()

    b = req("b", toks)
    assert rig.lookup(b, 0) == (6 * CHUNK, True)
    load(b, 6 * CHUNK, list(range(20, 33)))
    hashes = rig.sched._reqs["b"].hasher.known(6)
    rig.sched.load_failed("b", {hashes[5], hashes[4]})
    assert rig.lookup(b, 0) == (4 * CHUNK, True), "the failed part is a miss, the part before it hits"
    load(b, 4 * CHUNK, list(range(20, 33)))
    assert rig.lookup(b, 0) == (6 * CHUNK, True), "once: the next lookup asks for everything"
    load(b, 6 * CHUNK, list(range(20, 33)))
    # Named by request only (vLLM >= 0.33's failed_recving), the whole load is the failed part.
    rig.sched.load_failed("b")
    assert rig.lookup(b, 0) == (0, False)
    rig.sched.update_state_after_alloc("b", [list(range(20, 33))], 0)
    until(lambda: kvd.metric("kvd_lookup_pins") == 0)


def test_a_request_keeps_its_state_while_kvd_is_away(kvd_factory):
    """The scheduler keys chunks by kvd's chunk size (32 here, the connector's setting 256);
    while kvd is away it keeps the last size kvd said, so a request's state survives the
    reconnection: here, that its load failed, which must keep its next lookup a miss
    (recreated, the state forgot it)."""
    k = kvd_factory("--chunk-tokens", str(CHUNK))
    cfg = config(k.url, lookup_wait_s=0.0)
    cfg = KvdConfig(**{**cfg.__dict__, "chunk_tokens": 256})
    sched = KvdScheduler(cfg, [GroupInfo(FP, BLOCK, (0,), 1)], Connection(cfg, "s", "scheduler"))
    until(lambda: sched.conn.client() is not None)
    a = req("a", list(range(100)))
    until(lambda: sched.get_num_new_matched_tokens(a, 0)[0] is not None)
    st = sched._reqs["a"]
    sched.load_failed("a")
    port = k.port
    k.stop()
    sched.conn.lost("kvd stopped")
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    k2 = kvd_factory("--chunk-tokens", str(CHUNK), port=port)
    until(lambda: sched.conn.client() is not None, 10)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    assert sched._reqs["a"] is st and st.failed_from == 0, "the request's state outlived kvd's absence"
    k2.stop()


def test_a_state_group_in_blocks_smaller_than_the_chunk_is_told_the_chunk_to_use(kvd, caplog):
    """vLLM keeps a Mamba-style state only where a step ends; kvd serves a hit only with the
    state at a chunk's end. With 16-token state blocks and kvd's 32-token chunks most prompts
    get no hit: the connector says so once, naming the --chunk-tokens that fixes it."""
    cfg = config(kvd.url)
    sched = KvdScheduler(cfg, [GroupInfo(FP, 16, (0,), 1), GroupInfo(FP + 1, 16, (0,), 1, state=True)],
                         Connection(cfg, "sched", "scheduler"))
    with caplog.at_level("WARNING", logger="kvd"):
        until(lambda: sched.conn.client())
        sched.get_num_new_matched_tokens(req("a", list(range(100))), 0)
        sched.get_num_new_matched_tokens(req("b", list(range(200, 300))), 0)
    told = [r.getMessage() for r in caplog.records if "Mamba-style states" in r.getMessage()]
    assert len(told) == 1 and "--chunk-tokens 16" in told[0], told
    sched.conn.close()


def test_kvd_reads_back_from_its_disk_only_the_chunks_vllm_will_load(kvd_factory, tmp_path):
    # A 4 MiB L1 (112 chunks and the disk's write reserve, fixed at its largest: 16 chunks)
    # over a disk: prompts stored after A evict it there, first (FIFO).
    kvd = kvd_factory("--chunk-tokens", str(CHUNK), "--l1-size-gb", "0.004", "--eviction", "fifo",
                      "--disk", str(tmp_path / "disk"), "--disk-size-gb", "0.0625", "--disk-write-queue-mb", "1")
    rig = Rig(kvd.url)
    blocks = list(range(1, 21))
    a = req("a", list(range(300)))  # nine whole chunks and 12 tokens
    rig.lookup(a, 0)
    rig.run_prefill(a, blocks)
    rig.finish("a")
    expected = blocks_bytes(rig.views, blocks[:18])
    for i in range(16):
        other = req(f"o{i}", [10_000 * (i + 1) + t for t in range(300)])
        rig.lookup(other, 0)
        rig.run_prefill(other, list(range(30, 50)))
        rig.finish(other.req_id)
        # One prompt's evictions (9 chunks, under the reserve's 16) at a time: a burst of
        # them could outrun the reserve on a loaded machine and drop A's unwritten.
        until(lambda: not rig.worker.has_pending() and kvd.metric("kvd_l1_disk_writing_bytes") == 0 or None)
    until(lambda: kvd.metric(r'kvd_disk_evicted_chunks_total{outcome="written"}') >= 9
          and kvd.metric("kvd_l1_disk_writing_bytes") == 0 or None)
    assert kvd.metric(r'kvd_disk_evicted_chunks_total{outcome="dropped_busy"}') == 0
    assert kvd.metric(r'kvd_disk_fill_chunks_total{outcome="filled"}') == 0

    # B continues A; vLLM's prefix cache still holds A's first five chunks and a block.
    b = req("b", list(range(300)) + [7] * 40)
    computed = 5 * CHUNK + BLOCK
    assert rig.lookup(b, computed) == (9 * CHUNK - computed, True)
    assert kvd.metric(r'kvd_disk_fill_chunks_total{outcome="client_holds"}') == 5, "told what vLLM holds"
    blocks_b = list(range(42, 63))  # other blocks than A's: the load must write them
    assert blocks_bytes(rig.views, blocks_b[11:18]) != expected[11:18]
    rig.sched.update_state_after_alloc("b", [blocks_b], 9 * CHUNK - computed)
    rig.worker.start_load(rig.sched.build([]))
    _, recving = until(lambda: (lambda f: f if f[1] else None)(rig.worker.get_finished()))
    assert recving == {"b"} and rig.worker.failed_loads() == set()
    assert blocks_bytes(rig.views, blocks_b[11:18]) == expected[11:18], "the disk's chunks, bit-exact"
    assert kvd.metric(r'kvd_disk_fill_chunks_total{outcome="filled"}') == 4, "only the chunks vLLM loaded were read"
