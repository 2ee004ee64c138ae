"""kvd as a child of vLLM 0.33's real ``MultiConnector`` (CPU, real kvd, vLLM's Scheduler):

- **PD**: a prefill instance (kv_producer) and a decode instance (kv_consumer), each
  ``MultiConnector([NixlConnector, KvdConnector])`` over one kvd. The prefill stores its prompt
  in kvd and hands NixlConnector's transfer parameters to the decode; there NixlConnector is
  chosen to load the prompt, and kvd — which holds the same prefix — must load nothing: vLLM
  gives non-chosen children the real blocks with ``num_external_tokens == 0``. A request the
  decode gets without a remote prefill is then loaded from kvd, into exactly the blocks vLLM
  allocated, with the prefill instance's bytes.
- **beside OffloadingConnector**: ``MultiConnector([OffloadingConnector, KvdConnector])``
  builds, both Prometheus metric sets register (they share vLLM's family names), kvd's stats go
  through the MultiConnector's stats path (rebuilt by connector name in the frontend), and a
  kvd hit is loaded with OffloadingConnector told ``0``.

NixlConnector's scheduler side is constructed as vLLM constructs it (no nixl library is needed
there); its worker side needs nixl and a GPU, so the workers here are kvd's own (a KvdWorker over
a host KV cache, applying kvd's part of the MultiConnector's metadata), and NixlConnector's
pull is played by reporting it finished.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("vllm")

import msgspec  # noqa: E402
from prometheus_client import REGISTRY  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
    MultiKVConnectorMetadata,
    MultiKVConnectorStats,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

import kvd  # noqa: E402
import kvd.vllm  # noqa: E402
from kvd.testing import blocks_bytes, until, vllm_cache  # noqa: E402
from kvd.vllm_stats import KvdConnectorStats, worker_stats  # noqa: E402
from test_vllm_observability import copies_done  # noqa: E402
from test_vllm_conformance import (  # noqa: E402
    BLOCK,
    CHUNK,
    HEAD_SIZE,
    HEADS,
    LAYERS,
    make_kv_cache_config,
    make_vllm_config,
    request,
    runner_output,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _no_layout_override(monkeypatch):
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)


def kvd_child(url: str, role: str) -> dict[str, Any]:
    # NixlConnector and OffloadingConnector ask for LBHNC; MultiConnector refuses children that
    # disagree, so kvd is told the same (it handles every order).
    return {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.vllm", "kv_role": role,
            "kv_load_failure_policy": "recompute",
            # The asynchronous protocol, walked step by step as in test_vllm_conformance.py.
            "kv_connector_extra_config": {"kvd.url": url, "kvd.chunk_tokens": CHUNK, "kvd.layout": "LBHNC",
                                          "kvd.load_mode": "async"}}


def multi_config(url: str, role: str, first: dict[str, Any], engine_id: str):
    vc = make_vllm_config(url)
    vc.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector", kv_role=role, engine_id=engine_id, kv_load_failure_policy="recompute",
        kv_connector_extra_config={"connectors": [first, kvd_child(url, role)]},
    )
    return vc


class Instance:
    """One vLLM instance: its Scheduler (with the real MultiConnector) and kvd's worker."""

    def __init__(self, vc) -> None:
        layout, kvc = make_kv_cache_config(vc)
        assert layout.name == "LBHNC"
        self.vc = vc
        self.s = Scheduler(vllm_config=vc, kv_cache_config=kvc, structured_output_manager=StructuredOutputManager(vc),
                           block_size=BLOCK, log_stats=True)
        assert type(self.s.connector) is MultiConnector
        self.kvd_conn = self.s.connector._connectors[1]
        assert type(self.kvd_conn) is kvd.vllm.KvdConnector
        cfg = self.kvd_conn._cfg
        fp = kvd.vllm._group_fingerprint(vc, cfg, 0, kvc.kv_cache_groups[0])
        self.buf, self.views = vllm_cache(layout.name, len(LAYERS), kvc.num_blocks, HEADS, BLOCK, 2 * HEAD_SIZE)
        self.worker = kvd.KvdWorker(cfg, kvd.Connection(cfg, "w", "worker"), [kvd.WorkerGroup(fp, shard=0)])
        self.worker.register([self.views])
        until(lambda: all(r is not None for r in self.worker.registrations), what="registration")

    def kvd_meta(self, out) -> kvd.KvdMetadata:
        m = out.kv_connector_metadata
        assert isinstance(m, MultiKVConnectorMetadata)
        inner = m.metadata[1]
        assert isinstance(inner, kvd.vllm.KvdConnectorMetadata)
        return inner.inner

    def step(self, sampled: dict[str, list[int]] | None = None, kv: KVConnectorOutput | None = None,
             timeout: float = 5.0):
        """One step; kvd's worker applies kvd's part of the plan and its completions are reported
        (with ``kv`` merged in: what the other child's worker would report)."""
        out = self.s.schedule()
        meta = self.kvd_meta(out)
        self.worker.start_load(meta)
        self.worker.save(meta)
        until(lambda: copies_done(self.worker), timeout, "kvd's copies")
        sending, recving = self.worker.get_finished()
        kv = kv or KVConnectorOutput()
        kv.finished_sending = (kv.finished_sending or set()) | sending or None
        kv.finished_recving = (kv.finished_recving or set()) | recving or None
        kv.invalid_block_ids = self.worker.load_errors()
        # What MultiConnector.get_kv_connector_stats makes of its children's on the worker.
        stats = worker_stats(self.worker.take_stats())
        kv.kv_connector_stats = MultiKVConnectorStats(data={"KvdConnector": stats}) if stats else None
        sampled = {r: t for r, t in (sampled or {}).items() if r in out.num_scheduled_tokens}
        eco = self.s.update_from_output(out, runner_output(out, sampled, kv))
        return out, meta, eco

    def close(self) -> None:
        self.worker.shutdown()
        self.s.connector.shutdown()
        self.s.shutdown()


def nixl(role: str) -> dict[str, Any]:
    return {"kv_connector": "NixlConnector", "kv_role": role}


def test_pd_with_nixl_kvd_loads_only_what_vllm_allocated_for_it(server):
    tokens = list(range(100, 200))  # three whole chunks and four tokens
    p = Instance(multi_config(server.url, "kv_producer", nixl("kv_producer"), "prefill-0"))
    d = Instance(multi_config(server.url, "kv_consumer", nixl("kv_consumer"), "decode-0"))
    try:
        # --- prefill: computed, stored in kvd, and held for NixlConnector's pull
        p.s.add_request(request("p", tokens))
        p.s.requests["p"].kv_transfer_params = {"do_remote_decode": True}
        stores, params = [], None
        for _ in range(200):
            out, meta, eco = p.step({"p": [7]})
            stores += meta.stores
            for o in (x for e in eco.values() for x in e.outputs):
                params = o.kv_transfer_params or params
            if params:
                break
            time.sleep(0.002)
        assert params and params.get("do_remote_prefill"), params
        assert [len(op.groups[0]) for op in stores] == [3]
        prefill_blocks = p.s.kv_cache_manager.get_block_ids("p")[0]
        stored = blocks_bytes(p.views, prefill_blocks[:6])
        assert "p" in p.s.requests, "both children hold p's blocks: kvd for its stores, Nixl for the pull"

        # --- decode: NixlConnector is chosen; kvd, asked too and holding the prefix, loads nothing
        d.s.add_request(request("d", tokens))
        req_d = d.s.requests["d"]
        req_d.kv_transfer_params = dict(params)
        metas = []
        for _ in range(400):
            out, meta, _ = d.step()
            metas.append(meta)
            if req_d.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
            time.sleep(0.002)
        assert req_d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert d.s.connector._requests_to_connector.get("d") == 0, "NixlConnector was chosen"
        assert d.kvd_conn._sched.stats["hit_tokens"] == 3 * CHUNK, "kvd had the prefix to offer"
        assert all(m.loads == [] for m in metas), "kvd loads nothing it was not given"
        until(lambda: server.metric("kvd_lookup_pins") == 0, what="kvd's unused pins released")
        # Nixl's pull completes; the request runs; kvd stores none of the chunks it holds.
        out, meta, _ = d.step(kv=KVConnectorOutput(finished_recving={"d"}))
        for _ in range(5):
            out, meta, _ = d.step({"d": [7]})
            assert meta.loads == [] and meta.stores == []
            if "d" in out.num_scheduled_tokens:
                break
        assert "d" in out.num_scheduled_tokens

        # --- a request on the decode instance without a remote prefill: kvd is chosen (vLLM's
        # own prefix cache, which now holds d's blocks, emptied first so the hit is kvd's)
        assert "d" not in d.s.requests and d.s.reset_prefix_cache()
        d.s.add_request(request("e", tokens[:80] + list(range(700, 720))))
        req_e = d.s.requests["e"]
        for _ in range(400):
            out = d.s.schedule()
            meta = d.kvd_meta(out)
            if req_e.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
            d.s.update_from_output(out, runner_output(out))
            time.sleep(0.002)
        assert d.s.connector._requests_to_connector.get("e") == 1, "kvd was chosen"
        (load,) = meta.loads
        allocated = d.s.kv_cache_manager.get_block_ids("e")[0]
        ((_, chunks),) = load.groups
        assert [b for _, bs in chunks for b in bs] == list(allocated[:4]), "exactly the blocks vLLM allocated"
        d.worker.start_load(meta)
        _, recving = until(lambda: (lambda r: r if r[1] else None)(d.worker.get_finished()), what="kvd's load")
        assert recving == {"e"} and d.worker.failed_loads() == set()
        assert blocks_bytes(d.views, allocated[:4]) == stored[:4], "the prefill instance's bytes"
        d.s.update_from_output(out, runner_output(out, kv=KVConnectorOutput(finished_recving=recving)))
        out = d.s.schedule()
        assert out.num_scheduled_tokens.get("e") == 100 - 2 * CHUNK
    finally:
        p.close()
        d.close()


def offloading() -> dict[str, Any]:
    # OffloadingConnector's worker needs a GPU, so its stores never complete here, and a lookup
    # over a store in flight answers "ask again" until they do. With store_threshold 2 it
    # stores a chunk only when offered twice, so a's single pass leaves nothing in flight.
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20, "store_threshold": 2}}


def test_beside_offloading_connector_metrics_and_loads(server):
    i = Instance(multi_config(server.url, "kv_both", offloading(), "both-0"))
    try:
        # Both children's Prometheus metrics register, whichever comes first; kvd's series are
        # created at the first observation and share the OffloadingConnector's.
        prom = PrometheusStatLogger(i.vc)
        logging_logger = LoggingStatLogger(i.vc)
        tokens = list(range(300, 400))
        i.s.add_request(request("a", tokens))
        reports = []
        for _ in range(200):
            out, meta, eco = i.step({"a": [7]})
            for e in eco.values():
                if e.scheduler_stats is not None and e.scheduler_stats.kv_connector_stats:
                    reports.append(e.scheduler_stats)
            if "a" not in i.s.requests:
                break
            time.sleep(0.002)
        assert "a" not in i.s.requests
        assert reports and "KvdConnector" in reports[0].kv_connector_stats
        for stats in reports:
            # The frontend receives the dict through msgpack and rebuilds kvd's part by name.
            stats.kv_connector_stats = msgspec.msgpack.decode(msgspec.msgpack.encode(stats.kv_connector_stats))
            prom.record(stats, None)
            logging_logger.record(stats, None)
        logging_logger.log()
        labels = {"model_name": str(i.vc.model_config.served_model_name), "engine": "0"}
        stored = 3 * (CHUNK // BLOCK) * HEADS * BLOCK * 2 * HEAD_SIZE * 2 * len(LAYERS)
        assert REGISTRY.get_sample_value("vllm:kv_offload_store_bytes_total", labels) == stored, \
            "kvd's bytes, in the series OffloadingConnector registered"
        assert REGISTRY.get_sample_value("vllm:kv_offload_total_bytes_total",
                                         {**labels, "transfer_type": "GPU_to_CPU"}) == stored

        # kvd hits; OffloadingConnector (first, with nothing stored) is told 0.
        assert i.s.reset_prefix_cache()
        i.s.add_request(request("b", tokens[:80] + list(range(900, 940))))
        req_b = i.s.requests["b"]
        for _ in range(400):
            out = i.s.schedule()
            meta = i.kvd_meta(out)
            if req_b.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                break
            i.s.update_from_output(out, runner_output(out))
            time.sleep(0.002)
        assert i.s.connector._requests_to_connector.get("b") == 1
        (load,) = meta.loads
        assert [b for _, bs in load.groups[0][1] for b in bs] == list(i.s.kv_cache_manager.get_block_ids("b")[0][:4])
    finally:
        i.close()


@pytest.mark.parametrize("kvd_first", [False, True])
def test_prometheus_takes_kvd_and_offloading_connector_in_either_order(kvd_first):
    vc = multi_config("tcp://127.0.0.1:1", "kv_both", offloading(), "both-1")
    if kvd_first:
        connectors = vc.kv_transfer_config.kv_connector_extra_config["connectors"]
        connectors.reverse()
    prom = PrometheusStatLogger(vc)  # registers both children's metrics: no duplicate error
    data = {"KvdConnector": KvdConnectorStats(data={"store_bytes": 5, "store_seconds": 0.1, "store_sizes": [5]}).to_dict()}
    prom.kv_connector_prom.observe(msgspec.msgpack.decode(msgspec.msgpack.encode(data)), 0)
    labels = {"model_name": str(vc.model_config.served_model_name), "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:kv_offload_store_bytes_total", labels) == 5
    assert REGISTRY.get_sample_value("vllm:kv_offload_store_size_count", labels) == 1


@pytest.fixture
def server(kvd):
    return kvd
