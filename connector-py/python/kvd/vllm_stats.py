"""kvd's offload traffic in vLLM's stats log and ``/metrics``, under the families vLLM's own
OffloadingConnector exports (vLLM 0.26 to 0.33), so that dashboards and benchmark scripts read a
kvd deployment as they read vLLM's CPU offloading:

- ``vllm:kv_offload_{load,store}_bytes`` and ``..._time`` (counters, seconds) and
  ``..._size`` (histogram of bytes per transfer): load is kvd → GPU, store GPU → kvd;
- the older ``vllm:kv_offload_total_bytes`` / ``_total_time`` / ``_size`` with
  ``transfer_type`` ``CPU_to_GPU`` / ``GPU_to_CPU`` (vLLM still exports them, marked deprecated);
- ``vllm:kv_offload_allocation_failure``: chunks kvd refused to store (its pool was full of
  pinned pages);
- kvd's own ``vllm:kvd_lookups``, ``vllm:kvd_lookups_unwaited``, ``vllm:kvd_lookup_waits`` and
  ``vllm:kvd_lookup_timeouts`` (counters): the scheduler's lookups, those answered from kvd's
  presence filter without waiting for kvd (nothing beyond vLLM's own cache to load), those
  answered "ask again" (each holds its request back an engine step) and those that ran as a
  miss because kvd did not answer in time.

How the numbers travel: each worker's ``KvdWorker.take_stats`` and the scheduler's
``KvdScheduler.lookup_totals`` become ``KvdConnectorStats`` (``get_kv_connector_stats``),
vLLM sums the workers' and the scheduler's, ships ``to_dict()``
to the frontend, rebuilds it with ``build_kv_connector_stats`` and hands the dict to
``KvdPromMetrics.observe``. The scheduler's lookups travel twice: as increments, once, and as
totals since it started, for a few steps after they move. vLLM's offline engine (``LLM``, vLLM
0.26's ``LLMEngine.step``) records a step's stats only when the step has request outputs, and a
step that merely schedules a request (its lookup) may have none, so an increment sent once could
be lost (the real engine on an H100 lost 2 of 3, session 25): with one API server the frontend
adds what the totals grew by. With several (``--api-server-count``, data parallelism), a step's
stats go to one of them, each would count the totals' growth again, and their counters add up
in Prometheus: there it adds the increments (such a frontend is ``AsyncLLM``, which records
every step). The log line and ``reduce`` show increments. The workers' transfers are
increments: each step reports a transfer once, when it is done. The payload is flat (string
keys, numbers and lists) so that it survives vLLM's msgpack unchanged. Time is submission to
completion as the worker saw it, so it includes up to one step of polling and, for a store, the
wait for the forward pass that wrote its blocks: bytes over time is not the copy's rate.

Prefix-cache hits need nothing here: vLLM counts the tokens the connector supplies as
``external_kv_transfer`` in ``vllm:prompt_tokens_by_source`` and, from 0.33, under the
connector's ``_cache_hit_source`` (``host`` for kvd) in ``vllm:prompt_tokens_cached_by_source``.

One registry, two connectors: when kvd runs beside vLLM's OffloadingConnector in a
MultiConnector, both would register the same names, and prometheus_client refuses a name twice.
So kvd creates its collectors at its first observation (after every connector has registered
its own) and reuses a collector of the same name and labels that is already there: the two
tiers' traffic then adds up in one series, as two offloading tiers of one engine should.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvd.scheduler import LOOKUP_COUNTERS
from kvd.worker import TransferStats

LOAD_BYTES = "vllm:kv_offload_load_bytes"
LOAD_TIME = "vllm:kv_offload_load_time"
LOAD_SIZE = "vllm:kv_offload_load_size"
STORE_BYTES = "vllm:kv_offload_store_bytes"
STORE_TIME = "vllm:kv_offload_store_time"
STORE_SIZE = "vllm:kv_offload_store_size"
ALLOCATION_FAILURE = "vllm:kv_offload_allocation_failure"
TOTAL_BYTES = "vllm:kv_offload_total_bytes"
TOTAL_TIME = "vllm:kv_offload_total_time"
SIZE = "vllm:kv_offload_size"
#: kvd's own: the scheduler's lookups, those it answered "ask again" (kvd had not answered within
#: ``kvd.lookup_wait_s``: the request waits an engine step), and those kvd did not answer within
#: ``kvd.lookup_timeout_s`` (the request ran as a miss). Waits that climb with load are the sign
#: of a kvd that lags its engines.
LOOKUPS = "vllm:kvd_lookups"
LOOKUPS_UNWAITED = "vllm:kvd_lookups_unwaited"
LOOKUP_WAITS = "vllm:kvd_lookup_waits"
LOOKUP_TIMEOUTS = "vllm:kvd_lookup_timeouts"
#: transfer_type label values of the older families.
CPU_TO_GPU, GPU_TO_CPU = "CPU_to_GPU", "GPU_to_CPU"
#: vLLM's buckets for transfer sizes, in bytes.
SIZE_BUCKETS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)

#: The scheduler's lookup totals since it started, by counter (aggregated by maximum).
LOOKUP_TOTALS = {k: f"{k}_total" for k in LOOKUP_COUNTERS}
#: "reports" counts the scheduler's first-step report, which carries no traffic (see
#: scheduler_stats); the lookup counters and their totals are the scheduler's
#: (``kvd.scheduler.LOOKUP_COUNTERS``); the rest are the worker's TransferStats fields.
_COUNTERS = ("load_bytes", "load_seconds", "store_bytes", "store_seconds", "store_refused_chunks", "dropped_sizes",
             "reports") + LOOKUP_COUNTERS + tuple(LOOKUP_TOTALS.values())
_LISTS = ("load_sizes", "store_sizes")
_TOTALS = frozenset(LOOKUP_TOTALS.values())
#: Steps that carry the scheduler's lookup totals after they last moved: at least one of them
#: has request outputs (vLLM's offline engine drops the stats of a step without), unless the
#: engine goes idle, and then the next request's steps carry them.
RESEND_STEPS = 8


def _register_by_name() -> None:
    """MultiConnector rebuilds its children's stats in the frontend by connector name
    (KVConnectorFactory.get_connector_class_by_name): kvd must be findable by name there,
    though vLLM loads it by module path."""
    try:
        KVConnectorFactory.register_connector("KvdConnector", "kvd.vllm", "KvdConnector")
    except ValueError:  # registered already (a second import, or by the operator)
        pass


_register_by_name()


@dataclass
class KvdConnectorStats(KVConnectorStats):
    """kvd's transfer stats of one interval: ``data`` holds the counters of ``_COUNTERS`` and
    the per-transfer byte sizes of ``_LISTS``."""

    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        data = self.data
        if set(data) == {"data"} and isinstance(data["data"], dict):
            data = data["data"]  # vLLM 0.26's MultiConnector ships the dataclass's fields
        self.data = {k: data.get(k, 0) for k in _COUNTERS} | {k: list(data.get(k, ())) for k in _LISTS}

    @classmethod
    def of(cls, t: TransferStats) -> "KvdConnectorStats":
        return cls(data={k: getattr(t, k, 0) for k in _COUNTERS + _LISTS})

    def reset(self) -> None:
        self.data = {}
        self.__post_init__()

    def aggregate(self, other: KVConnectorStats) -> "KvdConnectorStats":
        if not isinstance(other, KvdConnectorStats):
            raise TypeError(f"cannot aggregate {type(other).__name__} into KvdConnectorStats")
        for k in _COUNTERS:
            if k in _TOTALS:  # the latest is the largest
                self.data[k] = max(self.data[k], other.data[k])
            else:
                self.data[k] += other.data[k]
        for k in _LISTS:
            self.data[k].extend(other.data[k])
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        for way in ("load", "store"):
            n, s = d[f"{way}_bytes"], d[f"{way}_seconds"]
            out[f"{way}_bytes"] = n
            out[f"{way}_seconds"] = round(s, 6)
            out[f"{way}_count"] = len(d[f"{way}_sizes"])
            out[f"{way}_GBps"] = round(n / s / 1e9, 3) if s > 0 else 0.0
        out["store_refused_chunks"] = d["store_refused_chunks"]
        for k in LOOKUP_COUNTERS:
            out[k] = d[k]
        return out

    def is_empty(self) -> bool:
        return not any(self.data[k] for k in _COUNTERS + _LISTS)

    def to_dict(self) -> dict[str, Any]:
        return self.data


class KvdPromMetrics(KVConnectorPromMetrics):
    """kvd's stats as vLLM's offloading families, one series per engine (and direction)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._bound: dict[tuple[str, int, str], Any] | None = None
        #: Per engine and lookup counter, the scheduler's total last counted.
        self._totals: dict[tuple[int, str], int] = {}
        #: One API server sees every step's stats (that vLLM records): count from the totals.
        self._by_totals = int(getattr(vllm_config.parallel_config, "_api_process_count", 1) or 1) == 1

    def _collector(self, kind: type, name: str, doc: str, labelnames: list[str], **kw: Any) -> Any:
        cls = {Counter: self._counter_cls, Histogram: self._histogram_cls, Gauge: self._gauge_cls}[kind]
        try:
            return cls(name=name, documentation=doc, labelnames=labelnames, **kw)
        except ValueError:
            # Registered already, by vLLM's OffloadingConnector beside kvd: share its series.
            names = getattr(REGISTRY, "_names_to_collectors", {})
            existing = names.get(name) or names.get(name + "_total")
            if existing is None or list(getattr(existing, "_labelnames", ())) != labelnames:
                raise
            return existing

    def _create(self) -> dict[tuple[str, int, str], Any]:
        """Every series, at zero, for every engine: created at the first observation."""
        ln, tt = self._labelnames, self._labelnames + ["transfer_type"]
        flat = {
            LOAD_BYTES: self._collector(Counter, LOAD_BYTES, "Total bytes loaded from offload storage to GPU.", ln),
            LOAD_TIME: self._collector(Counter, LOAD_TIME, "Total load time from offload storage to GPU, in seconds.", ln),
            LOAD_SIZE: self._collector(Histogram, LOAD_SIZE, "Histogram of KV offload load operation size, in bytes.",
                                       ln, buckets=SIZE_BUCKETS),
            STORE_BYTES: self._collector(Counter, STORE_BYTES, "Total bytes stored from GPU to offload storage.", ln),
            STORE_TIME: self._collector(Counter, STORE_TIME, "Total store time from GPU to offload storage, in seconds.", ln),
            STORE_SIZE: self._collector(Histogram, STORE_SIZE, "Histogram of KV offload store operation size, in bytes.",
                                        ln, buckets=SIZE_BUCKETS),
            ALLOCATION_FAILURE: self._collector(Counter, ALLOCATION_FAILURE,
                                                "Number of KV offload store allocation attempts that failed.", ln),
            LOOKUPS: self._collector(Counter, LOOKUPS, "Lookups vLLM's scheduler sent to kvd.", ln),
            LOOKUPS_UNWAITED: self._collector(Counter, LOOKUPS_UNWAITED, "Lookups answered from kvd's presence filter "
                                              "without waiting for kvd: nothing beyond vLLM's own cache to load.", ln),
            LOOKUP_WAITS: self._collector(Counter, LOOKUP_WAITS, "Lookups kvd had not answered within kvd.lookup_wait_s: "
                                          "the scheduler asked again an engine step later.", ln),
            LOOKUP_TIMEOUTS: self._collector(Counter, LOOKUP_TIMEOUTS, "Lookups kvd did not answer within "
                                             "kvd.lookup_timeout_s: the request ran as a miss.", ln),
        }
        by_type = {
            TOTAL_BYTES: self._collector(Counter, TOTAL_BYTES, "Number of bytes offloaded by KV connector", tt),
            TOTAL_TIME: self._collector(Counter, TOTAL_TIME, "Total time measured by all KV offloading operations", tt),
            SIZE: self._collector(Histogram, SIZE, "Histogram of KV offload transfer size, in bytes.", tt,
                                  buckets=SIZE_BUCKETS),
        }
        bound: dict[tuple[str, int, str], Any] = {}
        for engine, values in self.per_engine_labelvalues.items():
            for name, c in flat.items():
                bound[(name, engine, "")] = c.labels(*values)
            for name, c in by_type.items():
                for way in (CPU_TO_GPU, GPU_TO_CPU):
                    bound[(name, engine, way)] = c.labels(*values, way)
        return bound

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if self._bound is None:
            self._bound = self._create()
        d = KvdConnectorStats(data=transfer_stats_data).data
        m = self._bound
        for way, tt, nbytes, secs, size in (
            ("load", CPU_TO_GPU, LOAD_BYTES, LOAD_TIME, LOAD_SIZE),
            ("store", GPU_TO_CPU, STORE_BYTES, STORE_TIME, STORE_SIZE),
        ):
            if d[f"{way}_bytes"]:
                m[(nbytes, engine_idx, "")].inc(d[f"{way}_bytes"])
                m[(TOTAL_BYTES, engine_idx, tt)].inc(d[f"{way}_bytes"])
            if d[f"{way}_seconds"]:
                m[(secs, engine_idx, "")].inc(d[f"{way}_seconds"])
                m[(TOTAL_TIME, engine_idx, tt)].inc(d[f"{way}_seconds"])
            for n in d[f"{way}_sizes"]:
                m[(size, engine_idx, "")].observe(n)
                m[(SIZE, engine_idx, tt)].observe(n)
        if d["store_refused_chunks"]:
            m[(ALLOCATION_FAILURE, engine_idx, "")].inc(d["store_refused_chunks"])
        for key, name in (("lookups", LOOKUPS), ("lookups_unwaited", LOOKUPS_UNWAITED), ("lookup_waits", LOOKUP_WAITS),
                          ("lookup_timeouts", LOOKUP_TIMEOUTS)):
            if not self._by_totals:
                if d[key]:
                    m[(name, engine_idx, "")].inc(d[key])
                continue
            total = d[LOOKUP_TOTALS[key]]
            if not total:  # a worker's report, or nothing counted yet
                continue
            last = self._totals.get((engine_idx, key), 0)
            # Below what was counted: the engine's scheduler started again; count it from zero.
            grew = total - last if total >= last else total
            self._totals[(engine_idx, key)] = total
            if grew:
                m[(name, engine_idx, "")].inc(grew)


def worker_stats(t: TransferStats) -> KvdConnectorStats | None:
    """A worker's stats for vLLM, or None when nothing finished."""
    return None if t.is_empty() else KvdConnectorStats.of(t)


def scheduler_stats(grew: dict[str, int], totals: dict[str, int], first: bool) -> KvdConnectorStats | None:
    """The scheduler's lookups since its last report and their totals for vLLM, or None when
    there are none yet. Its first step reports even then, and is never empty (vLLM drops empty
    stats), so that the frontend creates every series at zero from the first step on."""
    data: dict[str, Any] = {k: v for k, v in grew.items() if v}
    data.update({LOOKUP_TOTALS[k]: v for k, v in totals.items() if v})
    if first:
        data["reports"] = 1
    return KvdConnectorStats(data=data) if data else None
