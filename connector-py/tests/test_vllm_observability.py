"""What vLLM 0.33 shows of kvd (#20), with vLLM's real Scheduler, worker-side KvdConnector (over a
host KV cache laid out as vLLM lays it out), KVOutputAggregator, msgpack transport, stat loggers
and event publisher, against a real kvd:

- kvd's transfers in ``/metrics`` under vLLM's offloading families (bytes and time per
  direction, sizes), and kvd's hits as external prefix-cache hits (``prompt_tokens_by_source``,
  ``prompt_tokens_cached_by_source{source="host"}``);
- ``BlockStored`` events for kvd's tier reaching a ZMQ subscriber of vLLM's publisher, with
  vLLM's own block hashes.

Run with ``pytest -m vllm`` where vLLM 0.33 is installed (scripts/vllm-conformance.sh).
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
import zmq  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from vllm.config import KVEventsConfig  # noqa: E402
from vllm.distributed.kv_events import MEDIUM_CPU, BlockStored, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger  # noqa: E402
from vllm.v1.metrics.stats import IterationStats  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import kvd  # noqa: E402
import kvd.vllm  # noqa: E402
from kvd.testing import free_port, until, vllm_cache  # noqa: E402
from kvd.vllm_stats import KvdConnectorStats  # noqa: E402
from test_vllm_conformance import (  # noqa: E402
    BLOCK,
    CHUNK,
    HEAD_SIZE,
    HEADS,
    LAYERS,
    make_kv_cache_config,
    make_vllm_config,
    meta_of,
    request,
    runner_output,
)

pytestmark = pytest.mark.vllm
BLOCK_BYTES = HEADS * BLOCK * 2 * HEAD_SIZE * 2  # one block of one layer (K and V, bf16)


@pytest.fixture(autouse=True)
def _no_layout_override(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def copies_done(worker: kvd.KvdWorker) -> bool:
    """Whether every submitted copy has completed (without taking the completions)."""
    loads = [c for load in worker._loads.values() for c in load.copies]
    return all(c.poll() for c in loads + [c for cs in worker._stores.values() for c in cs])


class Engine:
    """vLLM's scheduler with a worker-side KvdConnector, stepped as the engine core steps them:
    the worker connector is called in the model runner's order, its output goes through vLLM's
    KVOutputAggregator, and the engine core outputs through vLLM's msgpack."""

    def __init__(self, url: str, events_endpoint: str | None = None, **extra: object) -> None:
        vc = make_vllm_config(url, **extra)
        if events_endpoint is not None:
            vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                 endpoint=events_endpoint)
        layout, kvc = make_kv_cache_config(vc)
        self.vc = vc
        self.s = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                           block_size=BLOCK, log_stats=True)
        self.buf, views = vllm_cache(layout.name, len(LAYERS), kvc.num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE)
        self.buf.fill_random(1)
        self.w = kvd.vllm.KvdConnector(vc, KVConnectorRole.WORKER, kvc)
        self.w.register_kv_caches(dict(zip(LAYERS, views)))
        until(lambda: all(r is not None for r in self.w._worker.registrations), what="registration")
        self.aggregator = KVOutputAggregator(expected_finished_count=1)
        self.enc, self.dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

    def step(self, sampled: dict[str, list[int]] | None = None, settle: bool = True):
        """One engine step; returns (scheduler output, the engine core outputs as the frontend
        decodes them)."""
        out = self.s.schedule()
        w = self.w
        w.bind_connector_metadata(out.kv_connector_metadata)
        w.start_load_kv(None)
        w.wait_for_save()
        if settle:  # let this step's copies finish, so the step reports them
            until(lambda: copies_done(w._worker), what="copies")
        sampled = {r: t for r, t in (sampled or {}).items() if r in out.num_scheduled_tokens}
        mro = runner_output(out, sampled)
        kv = KVConnectorOutput()
        kv.finished_sending, kv.finished_recving = w.get_finished(out.finished_req_ids)
        kv.invalid_block_ids = w.get_block_ids_with_load_errors()
        kv.kv_connector_stats = w.get_kv_connector_stats()
        kv.kv_connector_worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        mro.kv_connector_output = kv
        agg = self.aggregator.aggregate([mro])
        eco = self.s.update_from_output(out, agg)
        frontend = {i: self.dec.decode(self.enc.encode(o)) for i, o in eco.items()}
        return out, frontend

    def close(self) -> None:
        self.w.shutdown()
        self.s.connector.shutdown()
        self.s.shutdown()


def step_until_scheduled(e: Engine, req_id: str, record) -> object:
    """Steps (sampling a token for ``req_id``) until the scheduler schedules ``req_id``, handing
    each step's frontend outputs to ``record``; returns that step's scheduler output."""
    for _ in range(200):
        out, frontend = e.step({req_id: [7]})
        record(frontend)
        if req_id in out.num_scheduled_tokens:
            return out
        time.sleep(0.002)
    raise AssertionError(f"{req_id} was not scheduled in 200 steps")


def metric(name: str, **labels: str) -> float:
    v = REGISTRY.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_offload_traffic_and_hits_show_in_vllms_metrics(server):
    e = Engine(server.url)
    prom = PrometheusStatLogger(e.vc)
    logging_logger = LoggingStatLogger(e.vc)
    labels = {"model_name": str(e.vc.model_config.served_model_name), "engine": "0"}

    def record(frontend) -> None:
        for eco in frontend.values():
            it = IterationStats()
            for o in eco.outputs:
                if o.prefill_stats is not None:
                    it.prompt_token_stats.update_from_output(o.prefill_stats)
            prom.record(eco.scheduler_stats, it)
            logging_logger.record(eco.scheduler_stats, it)

    try:
        # Step 1: a 100-token prompt is computed and its three whole chunks stored.
        a_tokens = list(range(100, 200))
        e.s.add_request(request("a", a_tokens))
        while True:
            out, frontend = e.step({"a": [7]})
            record(frontend)
            if "a" in out.num_scheduled_tokens:
                break
        assert [len(op.groups[0]) for op in meta_of(out).stores] == [3]
        stored = 3 * (CHUNK // BLOCK) * BLOCK_BYTES * len(LAYERS)
        assert metric("vllm:kv_offload_store_bytes_total", **labels) == stored
        assert metric("vllm:kv_offload_total_bytes_total", **labels, transfer_type="GPU_to_CPU") == stored
        assert metric("vllm:kv_offload_store_time_total", **labels) > 0
        assert metric("vllm:kv_offload_store_size_count", **labels) == 1
        assert metric("vllm:kv_offload_store_size_sum", **labels) == stored
        assert metric("vllm:kv_offload_load_bytes_total", **labels) == 0
        assert REGISTRY.get_sample_value("vllm:kv_offload_load_bytes_total", labels) == 0, "exists at zero"
        # The scheduler's lookups: a's one, asked again as often as the scheduler counted.
        sched = e.s.connector._sched
        assert metric("vllm:kvd_lookups_total", **labels) == sched.stats["lookups"] == 1
        assert metric("vllm:kvd_lookup_waits_total", **labels) == sched.stats["lookup_waits"]
        assert REGISTRY.get_sample_value("vllm:kvd_lookup_timeouts_total", labels) == 0, "exists at zero"

        # a finishes; its delayed free completes once its stores are reported.
        for _ in range(50):
            out, frontend = e.step()
            record(frontend)
            if "a" not in e.s.requests:
                break
        assert "a" not in e.s.requests
        assert e.s.reset_prefix_cache()

        # b shares a's first 80 tokens: two chunks come from kvd.
        e.s.add_request(request("b", a_tokens[:80] + list(range(500, 540))))
        out = step_until_scheduled(e, "b", record)
        (new,) = out.scheduled_new_reqs
        assert new.num_computed_tokens == 2 * CHUNK, "the hit counts as computed"
        loaded = 2 * (CHUNK // BLOCK) * BLOCK_BYTES * len(LAYERS)
        assert metric("vllm:kv_offload_load_bytes_total", **labels) == loaded
        assert metric("vllm:kv_offload_total_bytes_total", **labels, transfer_type="CPU_to_GPU") == loaded
        assert metric("vllm:kv_offload_load_time_total", **labels) > 0
        # kvd's hit is an external prefix-cache hit, from host memory.
        assert metric("vllm:prompt_tokens_by_source_total", **labels, source="external_kv_transfer") == 2 * CHUNK
        assert metric("vllm:prompt_tokens_cached_by_source_total", **labels, source="host") == 2 * CHUNK
        assert metric("vllm:external_prefix_cache_hits_total", **labels) == 2 * CHUNK
        assert metric("vllm:prompt_tokens_by_source_total", **labels, source="local_compute") == 100 + 120 - 2 * CHUNK
        assert metric("vllm:kvd_lookups_total", **labels) == sched.stats["lookups"] == 2
        assert metric("vllm:kvd_lookup_waits_total", **labels) == sched.stats["lookup_waits"]
        logging_logger.log()  # the log line reduces kvd's stats without error
    finally:
        e.close()


def test_lookups_reach_vllms_metrics_though_the_offline_engine_drops_steps_without_outputs(server):
    """vLLM's offline engine (``LLM``: vLLM 0.26's ``LLMEngine.step``) records a step's stats
    only when the step has request outputs. A request whose lookup kvd has not answered is
    asked again a step later: its steps have no outputs and their stats are dropped (vLLM 0.26
    on an H100 lost two of three lookups this way, session 25). The scheduler reports its
    totals for several steps after they move, so the steps with outputs carry them."""
    import os
    import signal

    e = Engine(server.url, **{"kvd.presence": False, "kvd.lookup_timeout_s": 30.0})
    prom = PrometheusStatLogger(e.vc)
    labels = {"model_name": str(e.vc.model_config.served_model_name), "engine": "0"}
    dropped = 0

    def record_as_the_offline_engine(frontend) -> None:
        nonlocal dropped
        for eco in frontend.values():
            if eco.scheduler_stats is None:
                continue
            if not eco.outputs:
                dropped += 1
                continue
            prom.record(eco.scheduler_stats, IterationStats())

    sched = e.s.connector._sched
    try:
        until(lambda: sched.conn.client() is not None, what="the scheduler's connection")
        server.sigstop()
        try:
            e.s.add_request(request("a", list(range(100, 200))))
            for _ in range(3):
                out, frontend = e.step(settle=False)
                assert "a" not in out.num_scheduled_tokens, "kvd is stopped: a's lookup is asked again"
                record_as_the_offline_engine(frontend)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        assert dropped == 3 and sched.stats["lookups"] == 1 and sched.stats["lookup_waits"] >= 3
        step_until_scheduled(e, "a", record_as_the_offline_engine)
        assert metric("vllm:kvd_lookups_total", **labels) == sched.stats["lookups"] == 1
        assert metric("vllm:kvd_lookup_waits_total", **labels) == sched.stats["lookup_waits"]
        assert metric("vllm:kvd_lookup_timeouts_total", **labels) == 0
    finally:
        e.close()


@pytest.mark.parametrize("api_servers", [1, 2])
def test_lookups_are_counted_once_whatever_the_number_of_api_servers(api_servers):
    """A step's stats reach one API server. With one, every step's do (that vLLM records), and
    the counters follow the scheduler's totals, which survive a dropped step; with several
    (data parallelism: one per engine), each sees some steps and Prometheus adds their
    counters up, so each adds the increments it was sent, never a total another also saw."""
    from prometheus_client import Counter, Gauge, Histogram

    vc = make_vllm_config("tcp://127.0.0.1:1")
    vc.parallel_config._api_process_count = api_servers
    values = {0: [f"api-servers-{api_servers}", "0"]}
    servers = [kvd.vllm_stats.KvdPromMetrics(vc, {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                                             ["model_name", "engine"], values) for _ in range(api_servers)]
    # Three steps' reports of one scheduler: 10 lookups, 2 more, 3 more (4 waits in all).
    steps = [kvd.vllm_stats.scheduler_stats({"lookups": 10, "lookup_waits": 1}, {"lookups": 10, "lookup_waits": 1}, True),
             kvd.vllm_stats.scheduler_stats({"lookups": 2}, {"lookups": 12, "lookup_waits": 1}, False),
             kvd.vllm_stats.scheduler_stats({"lookups": 3, "lookup_waits": 3}, {"lookups": 15, "lookup_waits": 4}, False),
             kvd.vllm_stats.scheduler_stats({}, {"lookups": 15, "lookup_waits": 4}, False)]  # a resend
    for i, st in enumerate(steps):
        servers[i % api_servers].observe(st.to_dict(), 0)
    labels = {"model_name": values[0][0], "engine": "0"}
    assert metric("vllm:kvd_lookups_total", **labels) == 15
    assert metric("vllm:kvd_lookup_waits_total", **labels) == 4


def test_stats_survive_vllms_transport_and_add_up():
    s = KvdConnectorStats(data={"store_bytes": 10, "store_seconds": 0.5, "store_sizes": [10]})
    t = KvdConnectorStats(data={"store_bytes": 5, "store_seconds": 0.25, "store_sizes": [5], "store_refused_chunks": 2,
                                "lookups": 3, "lookup_waits": 1})
    s.aggregate(t)
    # The scheduler's totals ride beside its increments: an earlier report of them adds nothing.
    s.aggregate(KvdConnectorStats(data={"lookups_total": 9, "lookup_waits_total": 4}))
    s.aggregate(KvdConnectorStats(data={"lookups_total": 7, "lookup_waits_total": 3}))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(s.to_dict()))
    back = kvd.vllm.KvdConnector.build_kv_connector_stats(wire)
    assert back.data == s.data and not back.is_empty()
    r = back.reduce()
    assert r["store_bytes"] == 15 and r["store_count"] == 2 and r["store_refused_chunks"] == 2
    assert (r["lookups"], r["lookup_waits"], r["lookup_timeouts"]) == (3, 1, 0)
    assert (s.data["lookups_total"], s.data["lookup_waits_total"]) == (9, 4)
    assert r["store_GBps"] == round(15 / 0.75 / 1e9, 3)
    # vLLM 0.26's MultiConnector ships the dataclass's fields: {"data": {...}}.
    assert kvd.vllm.KvdConnector.build_kv_connector_stats({"data": wire}).data == s.data
    assert KvdConnectorStats().is_empty()


def test_kv_events_for_kvds_tier_reach_a_subscriber(server):
    port = free_port()
    e = Engine(server.url, events_endpoint=f"tcp://*:{port}")  # "*": vLLM's publisher binds
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    time.sleep(0.3)  # a SUB socket misses what is published before it has joined
    try:
        tokens = list(range(100, 200))
        e.s.add_request(request("a", tokens))
        req = e.s.requests["a"]
        while True:
            out, _ = e.step({"a": [7]})
            if "a" in out.num_scheduled_tokens:
                break
        events: list = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and len([x for x in events if getattr(x, "medium", None) == MEDIUM_CPU]) < 3:
            e.step()
            if sub.poll(50):
                _, _, payload = sub.recv_multipart()
                events.extend(decoder.decode(payload).events)
        cpu = [x for x in events if isinstance(x, BlockStored) and x.medium == MEDIUM_CPU]
        per = CHUNK // BLOCK
        hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]  # as vLLM publishes them
        assert [x.block_hashes for x in cpu] == [hashes[c * per:(c + 1) * per] for c in range(3)], \
            "kvd's chunks, announced with vLLM's block hashes"
        assert [x.parent_block_hash for x in cpu] == [None, hashes[per - 1], hashes[2 * per - 1]]
        assert [x.token_ids for x in cpu] == [tokens[c * CHUNK:(c + 1) * CHUNK] for c in range(3)]
        assert {(x.block_size, x.group_idx, x.kv_cache_spec_kind) for x in cpu} == {(BLOCK, 0, "full_attention")}
        gpu = [x for x in events if isinstance(x, BlockStored) and x.medium == "GPU"]
        assert gpu and gpu[0].block_hashes[0] == hashes[0], "vLLM's own GPU events name the same hashes"
    finally:
        sub.close(0)
        ctx.term()
        e.close()


@pytest.fixture
def server(kvd):
    return kvd


@pytest.mark.parametrize("ranks, ready", [((True, True), True), ((True, False), False), ((None, False), False),
                                          ((None, None), None), ((True, None), True)])
def test_the_step_is_ready_only_when_every_rank_can_load(ranks, ready):
    """Each rank's worker metadata says whether it can load (``KvdWorker.ready``); vLLM's own
    KVOutputAggregator combines the ranks', and one rank that cannot makes the step's answer
    "not ready" (a rank that said nothing does not count)."""
    import copy

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    from kvd.vllm_events import KvdWorkerMetadata

    outs = []
    for i, r in enumerate(ranks):
        mro = copy.deepcopy(EMPTY_MODEL_RUNNER_OUTPUT)
        kv = KVConnectorOutput()
        kv.kv_connector_worker_meta = KvdWorkerMetadata([(0, 0, i, 7)], (1,), {}, r)
        mro.kv_connector_output = kv
        outs.append(mro)
    agg = KVOutputAggregator(expected_finished_count=len(ranks)).aggregate(outs)
    meta = agg.kv_connector_output.kv_connector_worker_meta
    assert meta.ready is ready
    assert sorted(meta.stored) == [(0, 0, 0, 7), (0, 0, 1, 7)], "and the ranks' other news is kept"
