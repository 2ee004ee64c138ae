"""Conformance with vLLM 0.33: ``kvd.vllm.KvdConnector`` loaded through vLLM's own
``KVConnectorFactory`` and driven by vLLM's real v1 ``Scheduler`` on CPU, against a real kvd.

The test plays the model runner: it hands the Scheduler made-up ``ModelRunnerOutput`` objects, and
acts as the worker by applying the step's ``KvdMetadata`` with a ``kvd.KvdWorker`` over a host KV
cache laid out exactly as vLLM lays out its own (checked against vLLM's ``allocate_kv_cache``).

Run with ``pytest -m vllm connector-py/tests/test_vllm_conformance.py`` in an environment with
vLLM 0.33 (``scripts/vllm-conformance.sh`` builds one).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")
if tuple(int(x) for x in vllm.__version__.split(".")[:2]) < (0, 33):
    # This file drives vLLM 0.33's layout resolution and allocator by name; test_vllm_engine.py
    # runs the engine loop on both releases.
    pytest.skip(f"vLLM {vllm.__version__}: these checks use vLLM 0.33's layout API", allow_module_level=True)

import torch  # noqa: E402  (vLLM brings torch)
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorRole,
    supports_hma,
)
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.attention.backends.utils import (  # noqa: E402
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

import kvd  # noqa: E402
import kvd.vllm  # noqa: E402
from kvd.testing import blocks_bytes, until, vllm_cache  # noqa: E402

pytestmark = pytest.mark.vllm

MODEL = Path(__file__).parent / "data" / "tiny-llama"  # config.json only: 2 layers, 2 KV heads of 64
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
HEADS, HEAD_SIZE = 2, 64
BLOCK = 16
CHUNK = 32  # kvd runs with --chunk-tokens 32
NUM_BLOCKS = 96
EOS = 2


# ---------------------------------------------------------------------------------------------
# vLLM objects


def make_vllm_config(url: str, **extra) -> VllmConfig:
    mc = ModelConfig(model=str(MODEL), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=4096, is_encoder_decoder=False)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    kt = KVTransferConfig(
        kv_connector="KvdConnector",
        kv_connector_module_path="kvd.vllm",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        # These tests walk vLLM's asynchronous load protocol step by step (a hit parks the
        # request in WAITING_FOR_REMOTE_KVS); test_vllm_engine.py runs the synchronous one.
        kv_connector_extra_config={"kvd.url": url, "kvd.chunk_tokens": CHUNK, "kvd.load_mode": "async", **extra},
    )
    return VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc, kv_transfer_config=kt,
                      device_config=DeviceConfig("cpu"))


def spec() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)


def make_kv_cache_config(vc: VllmConfig):
    """What the engine core does before it builds the Scheduler: resolve the layout (the
    connector's preference among what the attention backends accept), then plan the cache."""
    layout = resolve_kv_cache_layout(vc, [[l.name for l in get_supported_kv_cache_layouts([])]], [spec()])
    groups = [KVCacheGroupSpec(list(LAYERS), spec())]
    page = spec().page_size_bytes
    kvc = get_kv_cache_config_from_groups(vc, groups, available_memory=NUM_BLOCKS * page * len(LAYERS))
    vc.cache_config.num_gpu_blocks = kvc.num_blocks
    return layout, kvc


def make_scheduler(url: str, **extra):
    vc = make_vllm_config(url, **extra)
    layout, kvc = make_kv_cache_config(vc)
    s = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                  block_size=BLOCK, log_stats=True)
    return s, layout, kvc


init_none_hash(sha256)
_hasher = get_request_block_hasher(BLOCK, sha256)


def request(req_id: str, tokens: list[int], max_tokens: int = 1) -> Request:
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS)
    return Request(request_id=req_id, prompt_token_ids=tokens, sampling_params=sp, pooling_params=None,
                   block_hasher=_hasher)


def runner_output(out, sampled: dict[str, list[int]] | None = None, kv: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    """What the model runner returns for ``out``: every scheduled request, with ``sampled`` tokens
    for those whose prefill completed, and the workers' connector output."""
    sampled = sampled or {}
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[sampled.get(r, []) for r in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv)


def meta_of(out) -> kvd.KvdMetadata:
    m = out.kv_connector_metadata
    assert isinstance(m, kvd.vllm.KvdConnectorMetadata), type(m)
    assert isinstance(m.inner, kvd.KvdMetadata), type(m.inner)
    return m.inner


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def schedule_until(s: Scheduler, req_id: str, timeout: float = 5.0):
    """Steps the scheduler (with empty model output) until it schedules ``req_id``; returns that
    step's SchedulerOutput and the number of steps it took."""
    steps = 0
    deadline = time.monotonic() + timeout
    while True:
        out = s.schedule()
        steps += 1
        if req_id in out.num_scheduled_tokens:
            return out, steps
        assert not meta_of(out).stores, "nothing was computed, so nothing is stored"
        s.update_from_output(out, runner_output(out))
        if time.monotonic() > deadline:
            req = s.requests.get(req_id)
            raise AssertionError(f"{req_id} was not scheduled within {timeout} s "
                                 f"(status {req.status.name if req else None})")
        time.sleep(0.005)


@contextlib.contextmanager
def paused(k):
    """Stops the kvd process (SIGSTOP) for the duration: requests wait, unanswered."""
    k.sigstop()
    try:
        yield
    finally:
        os.kill(k.proc.pid, signal.SIGCONT)


class HostWorker:
    """The worker side: a KvdWorker over a host KV cache with vLLM's layout."""

    def __init__(self, s: Scheduler, layout: KVCacheLayout, kvc) -> None:
        self.cfg = s.connector._cfg
        group = kvc.kv_cache_groups[0]
        fp = kvd.vllm._group_fingerprint(s.vllm_config, self.cfg, 0, group)
        self.buf, self.views = vllm_cache(layout.name, len(LAYERS), kvc.num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE)
        self.buf.fill_random(1)
        self.worker = kvd.KvdWorker(self.cfg, kvd.Connection(self.cfg, "w", "worker"), [kvd.WorkerGroup(fp, shard=0)])
        self.worker.register([self.views])
        until(lambda: all(r is not None for r in self.worker.registrations), what="registration")

    def finished(self, timeout: float = 5.0, sending: bool = False, recving: bool = False) -> tuple[set[str], set[str]]:
        """Polls ``get_finished`` until it reports what is asked for (and nothing is in flight)."""
        acc_s: set[str] = set()
        acc_r: set[str] = set()

        def poll():
            s, r = self.worker.get_finished()
            acc_s.update(s)
            acc_r.update(r)
            return (not sending or acc_s) and (not recving or acc_r) and not self.worker.has_pending()

        until(poll, timeout, "worker completion")
        return acc_s, acc_r

    def close(self) -> None:
        self.worker.shutdown()


# ---------------------------------------------------------------------------------------------
# tests


@pytest.fixture(autouse=True)
def _no_layout_override(monkeypatch):
    # An explicit VLLM_KV_CACHE_LAYOUT would win over the connector's choice.
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


@pytest.fixture
def server(kvd):  # conftest's kvd process, renamed so that ``kvd`` stays the package here
    return kvd


@pytest.mark.parametrize(("configured", "asked"), [(None, "BLNHC"), ("BLNHC", "BLNHC"), ("none", None)])
def test_factory_loads_kvd_connector_and_its_layout_wins(configured, asked):
    # By default ("auto") the connector asks this vLLM for blocks outermost by name; "none"
    # leaves the layout to vLLM (the backends' first choice).
    extra = {} if configured is None else {"kvd.layout": configured}
    vc = make_vllm_config("tcp://127.0.0.1:1", **extra)
    cls = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
    assert cls is kvd.vllm.KvdConnector
    assert supports_hma(cls), "KvdConnector implements request_finished_all_groups"
    assert cls.get_required_kvcache_layout(vc) == asked
    assert not cls.requires_piecewise_for_cudagraph(vc.kv_transfer_config.kv_connector_extra_config)

    # The engine core's resolution picks the connector's layout, or else the backends' first
    # choice, and vLLM's planner and allocator then produce exactly the views kvd.testing models.
    layout, kvc = make_kv_cache_config(vc)
    want = KVCacheLayout[asked] if asked is not None else get_supported_kv_cache_layouts([])[0]
    assert layout is want and vc.cache_config.kv_cache_layout == want.name
    assert kvc.num_blocks == NUM_BLOCKS and len(kvc.kv_cache_groups) == 1
    real = allocate_kv_cache(kvc, torch.device("meta"), layout)
    buf, views = vllm_cache(layout.name, len(LAYERS), kvc.num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE)
    assert buf.size == kvc.kv_cache_tensors[0].size
    for name, v in zip(LAYERS, views):
        t = real[name]
        assert (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.element_size()) == (
            v.shape, v.strides, v.offset, v.elem), name


def test_connector_is_created_by_the_scheduler(server):
    s, _, kvc = make_scheduler(server.url)
    try:
        assert type(s.connector) is kvd.vllm.KvdConnector
        assert s.connector.role == KVConnectorRole.SCHEDULER
        assert s.connector._sched is not None and s.connector._worker is None
        assert s.connector._sched.chunk_tokens == CHUNK
        assert s.requires_kv_delivery is False, "a preempted request's KV need not be delivered"
        assert s.recompute_kv_load_failures is True
    finally:
        s.connector.shutdown()


def test_a_prompt_kvd_certainly_lacks_is_scheduled_at_once_even_with_kvd_paused(server):
    # kvd's presence filter says kvd lacks the prompt's first chunk: vLLM's scheduler gets
    # "nothing to load" without waiting for kvd (stopped here), schedules the request in the
    # same step, and the step's plan stores every whole chunk from the first.
    s, layout, kvc = make_scheduler(server.url)
    try:
        tokens = list(range(5100, 5200))
        s.add_request(request("a", tokens))
        with paused(server):
            out = s.schedule()
            assert out.num_scheduled_tokens == {"a": 100}
            assert s.connector._sched.stats["lookups_unwaited"] == 1
            (op,) = meta_of(out).stores
            hashes = kvd.chunk_hashes(tokens[: 3 * CHUNK], CHUNK)
            assert [h for h, _ in op.groups[0]] == hashes
    finally:
        s.connector.shutdown()


def test_store_delayed_free_and_async_hit_through_the_scheduler(server):
    # The presence filter off: this walks a lookup kvd has not answered yet (the filter would
    # answer this new prompt without kvd: the test above).
    s, layout, kvc = make_scheduler(server.url, **{"kvd.presence": False})
    w = HostWorker(s, layout, kvc)
    try:
        # --- (a) the first request: the lookup asks to be called again, then it is a miss
        a_tokens = list(range(100, 200))  # 100 tokens: three whole chunks
        s.add_request(request("a", a_tokens))
        # kvd answers a lookup in ~50 us, which can beat the connector's first look at it; hold
        # kvd still so that the lookup is certainly pending for a few steps.
        with paused(server):
            for _ in range(3):
                out = s.schedule()
                assert out.num_scheduled_tokens == {}, "not scheduled while kvd's lookup is pending"
                assert s.requests["a"].status == RequestStatus.WAITING
                assert meta_of(out).is_empty()
                s.update_from_output(out, runner_output(out))
        assert s.connector._sched.stats["lookups"] == 1, "one lookup, asked again each step"
        out, _ = schedule_until(s, "a")
        assert out.num_scheduled_tokens == {"a": 100}
        (new,) = out.scheduled_new_reqs
        assert new.num_computed_tokens == 0, "a miss: vLLM computes everything"
        assert not out.has_sync_kv_loads
        blocks_a = list(new.block_ids[0])
        assert len(blocks_a) == 7

        # --- (b) the step's plan stores the three whole chunks from the request's real blocks
        meta = meta_of(out)
        assert meta.loads == [] and meta.delayed == []
        (op,) = meta.stores
        assert op.req_id == "a" and op.salt == 0
        hashes = kvd.chunk_hashes(a_tokens[: 3 * CHUNK], CHUNK)
        assert op.groups == [[(hashes[c], blocks_a[2 * c: 2 * c + 2]) for c in range(3)]]
        # vLLM pickles the SchedulerOutput to its workers.
        assert pickle.loads(pickle.dumps(out.kv_connector_metadata)).inner == meta
        w.worker.save(meta)  # the worker, after the forward pass
        w.finished()
        assert w.worker.stats["stored_chunks"] == 3
        stored = blocks_bytes(w.views, blocks_a[:6])

        # --- (c) the request finishes: vLLM keeps its blocks until kvd reports the stores done
        free_before = free_blocks(s)
        s.update_from_output(out, runner_output(out, {"a": [7]}))
        assert s.requests["a"].status == RequestStatus.FINISHED_LENGTH_CAPPED
        # vLLM's request_finished named the blocks it frees (now, or once the stores are done):
        # a load into one of them in the next two passes waits for the model's stream.
        assert set(blocks_a) <= s.connector._sched._freed[0]
        assert "a" in s.requests, "request_finished_all_groups delayed the free"
        assert free_blocks(s) == free_before, "the blocks are still held"
        out = s.schedule()
        assert "a" in out.finished_req_ids
        meta = meta_of(out)
        assert meta.delayed == ["a"] and meta.stores == [] and meta.loads == []
        assert s.connector.has_pending_push_work(), "vLLM keeps stepping while a free is delayed"
        w.worker.save(meta)
        sending, recving = w.finished(sending=True)
        assert (sending, recving) == ({"a"}, set())
        s.update_from_output(out, runner_output(out, kv=KVConnectorOutput(finished_sending=sending)))
        assert "a" not in s.requests
        assert free_blocks(s) == free_before + len(blocks_a), "finished_sending freed the blocks"
        assert not s.connector.has_pending_push_work()

        # vLLM's own prefix cache now holds all of a's blocks (it would win over kvd); evict
        # them, as memory pressure would, so that only kvd has the prefix.
        assert s.reset_prefix_cache()
        w.buf.fill_random(2)  # and forget the cache's contents: only kvd has the bytes now

        # --- (d) a request sharing 80 tokens (two whole chunks) hits asynchronously
        b_tokens = a_tokens[:80] + list(range(500, 540))  # 120 tokens
        s.add_request(request("b", b_tokens))
        req_b = s.requests["b"]
        steps = 0
        while req_b.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            assert req_b.status == RequestStatus.WAITING, req_b.status
            out = s.schedule()
            steps += 1
            assert "b" not in out.num_scheduled_tokens
            if req_b.status == RequestStatus.WAITING:
                assert meta_of(out).loads == [], "no load before the lookup answered"
                s.update_from_output(out, runner_output(out))
                assert steps < 1000, "the lookup never answered"
                time.sleep(0.005)
        assert req_b.num_computed_tokens == 2 * CHUNK
        blocks_b = list(s.kv_cache_manager.get_blocks("b").get_block_ids()[0])
        assert not set(blocks_b) & set(blocks_a[:4]), "the hit goes into other blocks"
        meta = meta_of(out)
        assert meta.stores == [] and meta.delayed == []
        (load,) = meta.loads
        assert load.req_id == "b" and load.salt == 0
        # vLLM 0.33 hands b a's last block (partial, so not cached), freed by a's delayed free
        # within the last two plans: a pass still on the GPU may use it, so the copy waits for the model's
        # stream. A load into blocks freed earlier starts at once (test_connector.py).
        loaded = {b for _, chunks in load.groups for _, bs in chunks for b in bs}
        assert load.wait == bool(loaded & set(blocks_a)), (loaded, blocks_a)
        (([pin], chunks),) = load.groups
        assert pin != 0, "the lookup pinned the hit until the worker reads it"
        assert chunks == [(hashes[0], blocks_b[0:2]), (hashes[1], blocks_b[2:4])]
        assert server.metric("kvd_lookup_pins") == 1
        untouched = blocks_bytes(w.views, blocks_b[4:])

        w.worker.start_load(meta)
        sending, recving = w.finished(recving=True)
        assert (sending, recving) == (set(), {"b"})
        assert w.worker.load_errors() == set() and w.worker.failed_loads() == set()
        assert blocks_bytes(w.views, blocks_b[:4]) == stored[:4], "the hit holds exactly the bytes stored"
        assert blocks_bytes(w.views, blocks_b[4:]) == untouched, "nothing beyond the hit was written"
        until(lambda: server.metric("kvd_lookup_pins") == 0, what="pin release")

        s.update_from_output(out, runner_output(out, kv=KVConnectorOutput(finished_recving=recving)))
        out = s.schedule()
        assert out.num_scheduled_tokens == {"b": 120 - 2 * CHUNK}
        (new,) = out.scheduled_new_reqs
        assert new.req_id == "b" and new.num_computed_tokens == 2 * CHUNK, "the hit counts as computed"
        assert list(new.block_ids[0])[:4] == blocks_b[:4]
        # The hit is not stored again; the third chunk (tokens 64..95 of b) is new.
        meta = meta_of(out)
        assert meta.loads == []
        (op,) = meta.stores
        b_hashes = kvd.chunk_hashes(b_tokens[: 3 * CHUNK], CHUNK)
        assert b_hashes[:2] == hashes[:2] and b_hashes[2] != hashes[2]
        assert op.req_id == "b" and op.groups == [[(b_hashes[2], list(new.block_ids[0])[4:6])]]
        stats = s.connector._sched.stats
        assert stats["hit_tokens"] == 2 * CHUNK and stats["stored_chunks"] == 4
    finally:
        w.close()
        s.connector.shutdown()


def store_and_finish(s: Scheduler, w: HostWorker, req_id: str, tokens: list[int]) -> list[int]:
    """Runs a request through prefill (stores applied by the worker) to its delayed free; returns
    its block ids."""
    s.add_request(request(req_id, tokens))
    out, _ = schedule_until(s, req_id)
    blocks = list(out.scheduled_new_reqs[0].block_ids[0])
    w.worker.save(meta_of(out))
    w.finished()
    s.update_from_output(out, runner_output(out, {req_id: [7]}))
    out = s.schedule()
    assert meta_of(out).delayed == [req_id]
    w.worker.save(meta_of(out))
    sending, _ = w.finished(sending=True)
    s.update_from_output(out, runner_output(out, kv=KVConnectorOutput(finished_sending=sending)))
    assert req_id not in s.requests
    return blocks


def test_a_failed_load_is_recomputed(kvd_factory):
    """kvd dies between the lookup and the load: the worker reports the load failed, vLLM
    (kv_load_failure_policy=recompute) drops the hit, asks the connector again, and computes."""
    k = kvd_factory("--chunk-tokens", "32")
    s, layout, kvc = make_scheduler(k.url)
    w = HostWorker(s, layout, kvc)
    try:
        a_tokens = list(range(100, 200))
        store_and_finish(s, w, "a", a_tokens)
        assert s.reset_prefix_cache()
        s.add_request(request("b", a_tokens[:80] + list(range(500, 540))))
        req_b = s.requests["b"]
        while req_b.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            out = s.schedule()
            if req_b.status == RequestStatus.WAITING:
                s.update_from_output(out, runner_output(out))
                time.sleep(0.005)
        (load,) = meta_of(out).loads
        load_blocks = {b for _, chunks in load.groups for _, bs in chunks for b in bs}
        k.stop()

        w.worker.start_load(meta_of(out))
        _, recving = w.finished(recving=True)
        assert recving == {"b"}
        failed, errors = w.worker.failed_loads(), w.worker.load_errors()
        assert failed == {"b"} and errors == load_blocks
        s.update_from_output(out, runner_output(out, kv=KVConnectorOutput(
            finished_recving=recving, failed_recving=failed, invalid_block_ids=errors)))

        out, _ = schedule_until(s, "b", timeout=5)
        assert out.num_scheduled_tokens == {"b": 120}, "the whole prompt is computed"
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        assert meta_of(out).loads == []
    finally:
        w.close()
        s.connector.shutdown()


def test_chunked_prefill_stores_each_chunk_from_the_blocks_of_its_step(server):
    """A prompt longer than the step's token budget is prefilled over two steps; the second
    step's blocks reach the connector through scheduled_cached_reqs.new_block_ids."""
    s, layout, kvc = make_scheduler(server.url)
    w = HostWorker(s, layout, kvc)
    try:
        tokens = list(range(300))  # max_num_batched_tokens is 256
        s.add_request(request("a", tokens))
        out, _ = schedule_until(s, "a")
        assert out.num_scheduled_tokens == {"a": 256}
        blocks = list(out.scheduled_new_reqs[0].block_ids[0])
        assert len(blocks) == 16
        hashes = kvd.chunk_hashes(tokens[: 9 * CHUNK], CHUNK)
        (op,) = meta_of(out).stores
        assert op.groups == [[(hashes[c], blocks[2 * c: 2 * c + 2]) for c in range(8)]]
        w.worker.save(meta_of(out))
        w.finished()
        s.update_from_output(out, runner_output(out))  # no token sampled mid-prefill

        out = s.schedule()
        assert out.num_scheduled_tokens == {"a": 44}
        cached = out.scheduled_cached_reqs
        assert cached.req_ids == ["a"] and "a" not in cached.resumed_req_ids
        blocks += list(cached.new_block_ids[0][0])
        assert len(blocks) == 19
        (op,) = meta_of(out).stores
        assert op.groups == [[(hashes[8], blocks[16:18])]], "the ninth chunk, from the new blocks"
        w.worker.save(meta_of(out))
        w.finished()
        assert w.worker.stats["stored_chunks"] == 9
    finally:
        w.close()
        s.connector.shutdown()


def test_a_preempted_request_resumes_from_kvd(server):
    """A running request is preempted (here by reset_prefix_cache(reset_running_requests=True),
    which also empties vLLM's prefix cache); when it is scheduled again, the connector looks it up
    afresh and it resumes from kvd instead of recomputing its prompt."""
    s, layout, kvc = make_scheduler(server.url)
    w = HostWorker(s, layout, kvc)
    try:
        tokens = list(range(100, 200))
        s.add_request(request("a", tokens, max_tokens=4))
        out, _ = schedule_until(s, "a")
        blocks_a = list(out.scheduled_new_reqs[0].block_ids[0])
        w.worker.save(meta_of(out))
        w.finished()
        stored = blocks_bytes(w.views, blocks_a[:6])
        s.update_from_output(out, runner_output(out, {"a": [7]}))
        req_a = s.requests["a"]
        assert req_a.status == RequestStatus.RUNNING and req_a.num_tokens == 101

        assert s.reset_prefix_cache(reset_running_requests=True)
        assert req_a.status == RequestStatus.PREEMPTED and req_a.num_computed_tokens == 0
        w.buf.fill_random(3)

        while req_a.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            out = s.schedule()
            assert "a" not in out.num_scheduled_tokens, "resumed from kvd, not recomputed"
            if req_a.status == RequestStatus.PREEMPTED:
                s.update_from_output(out, runner_output(out))
                time.sleep(0.005)
        assert req_a.num_computed_tokens == 3 * CHUNK
        (load,) = meta_of(out).loads
        blocks = list(s.kv_cache_manager.get_blocks("a").get_block_ids()[0])
        hashes = kvd.chunk_hashes(tokens[: 3 * CHUNK], CHUNK)
        assert load.groups[0][1] == [(hashes[c], blocks[2 * c: 2 * c + 2]) for c in range(3)]
        w.worker.start_load(meta_of(out))
        _, recving = w.finished(recving=True)
        assert w.worker.failed_loads() == set()
        assert blocks_bytes(w.views, blocks[:6]) == stored
        s.update_from_output(out, runner_output(out, kv=KVConnectorOutput(finished_recving=recving)))

        out = s.schedule()
        assert out.num_scheduled_tokens == {"a": 101 - 3 * CHUNK}
        if s.use_v2_model_runner:  # Model Runner V2 gets a resumed request as a new one
            (new,) = out.scheduled_new_reqs
            assert new.req_id == "a" and new.num_computed_tokens == 3 * CHUNK
            resumed_blocks = list(new.block_ids[0])
        else:
            cached = out.scheduled_cached_reqs
            assert cached.req_ids == ["a"] and "a" in cached.resumed_req_ids
            resumed_blocks = list(cached.new_block_ids[0][0])
        assert resumed_blocks[:6] == blocks[:6]
        assert meta_of(out).stores == [], "the prompt's chunks are all in kvd already"
        until(lambda: server.metric("kvd_lookup_pins") == 0, what="every lookup pin released")
    finally:
        w.close()
        s.connector.shutdown()


def test_kvd_gone_means_misses_without_delay(kvd_factory):
    k = kvd_factory("--chunk-tokens", "32")
    s, layout, kvc = make_scheduler(k.url)
    w = HostWorker(s, layout, kvc)
    try:
        # A request while kvd is up: looked up, scheduled, stored.
        s.add_request(request("a", list(range(100))))
        out, _ = schedule_until(s, "a")
        meta = meta_of(out)
        assert len(meta.stores) == 1
        w.worker.save(meta)
        w.finished()
        k.stop()
        until(lambda: s.connector._sched.conn.client() is None, 2, "the scheduler noticing that kvd is gone")

        # kvd is gone. The finished request's delayed free still completes (the worker reports
        # it), and a new request is scheduled in its very first step, as a miss.
        s.update_from_output(out, runner_output(out, {"a": [7]}))
        assert "a" in s.requests, "a's stores were planned, so its free is delayed"
        s.add_request(request("b", list(range(1000, 1100))))
        t = time.monotonic()
        out = s.schedule()
        assert time.monotonic() - t < 0.5
        assert out.num_scheduled_tokens == {"b": 100}, "scheduled in the first step, as a miss"
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        meta = meta_of(out)
        assert meta.delayed == ["a"] and meta.loads == [] and meta.stores == [], "nothing is stored without kvd"
        w.worker.save(meta)
        sending, recving = w.finished(sending=True)
        assert (sending, recving) == ({"a"}, set())
        s.update_from_output(out, runner_output(out, {"b": [7]}, KVConnectorOutput(finished_sending=sending)))
        assert "a" not in s.requests, "finished_sending freed a's blocks"
        assert "b" not in s.requests, "b stored nothing, so its blocks were freed at once"
        out = s.schedule()
        assert meta_of(out).delayed == [], "b was never delayed"
        assert not s.connector.has_pending_push_work()
    finally:
        w.close()
        s.connector.shutdown()

    # A scheduler whose kvd is not there at all starts, and serves misses at once, too.
    t = time.monotonic()
    s, _, _ = make_scheduler(k.url, **{"kvd.connect_timeout_s": 0.5})
    try:
        assert time.monotonic() - t < 5
        s.add_request(request("c", list(range(200))))
        out = s.schedule()
        assert out.num_scheduled_tokens == {"c": 200}
        assert out.scheduled_new_reqs[0].num_computed_tokens == 0
        assert meta_of(out).is_empty()
    finally:
        s.connector.shutdown()
