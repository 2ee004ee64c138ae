"""``KvdConnector``: vLLM's KV connector for kvd.

Use it with::

    --kv-transfer-config '{"kv_connector":"KvdConnector","kv_connector_module_path":"kvd.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"kvd.url":"tcp://127.0.0.1:5555"}}'

This class is a thin adapter: it turns vLLM's objects (requests, scheduler output, KV tensors)
into the plain values that ``kvd.KvdScheduler`` and ``kvd.KvdWorker`` work on.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1 import base as _vllm_base
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        SupportsHMA,
    )
except ImportError as e:  # pragma: no cover - exercised without vLLM
    raise ImportError(
        "kvd.vllm is vLLM's connector for kvd and needs vLLM >= 0.26 (pip install 'vllm>=0.26'); "
        "the rest of the kvd package works without it"
    ) from e

# vLLM >= 0.33 reports failed receives separately; None where this vLLM does not.
KVConnectorTransferResults: Any = getattr(_vllm_base, "KVConnectorTransferResults", None)

try:  # vLLM >= 0.33 counts external hits by the tier that supplied them
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _CacheHitSource
except ImportError:  # pragma: no cover - older vLLM
    _CacheHitSource = None

from kvd import vllm_events, vllm_stats
from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.groups import GroupFacts, group_facts, unsupported
from kvd.layout import LayoutError
from kvd.keys import Span, fingerprint, salt_hash
from kvd.metadata import KvdMetadata
from kvd.scheduler import GroupInfo, KvdScheduler, SchedRequest
from kvd.warm import WARM_PARAM
from kvd.worker import KvdWorker, WorkerGroup

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvd")


class KvdConnectorMetadata(KVConnectorMetadata):
    """The step's plan, as vLLM carries it to the workers."""

    def __init__(self, inner: KvdMetadata) -> None:
        self.inner = inner


def _ranks(vllm_config: "VllmConfig") -> tuple[int, int, int, int]:
    """(tp rank, tp size, pp rank, pp size) of this process (ranks are 0 on the scheduler)."""
    pc = vllm_config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank(), tp, get_pp_group().rank_in_group, pp
    except Exception:  # not initialised: the scheduler process
        return pc.rank % tp, tp, pc.rank // tp, pp


def _group_fingerprint(vllm_config: "VllmConfig", cfg: KvdConfig, g: int, group: Any) -> int:
    """The key fingerprint of group ``g``, from facts the scheduler and the workers see alike:
    the group's first layer spec (never the wrapper a worker's config has around it), its layer
    names, the model, cache dtype, layout and parallelism."""
    mc = vllm_config.model_config
    facts = group_facts(group.kv_cache_spec)
    model = cfg.model_id or f"{mc.model}@{getattr(mc, 'revision', None)}"
    layout = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    # vLLM 0.26 names no layout in its config: whether it was asked for its cross-layer buffer
    # (blocks outermost) tells the page order, so engines configured apart never share keys
    # (kvd refuses a fingerprint registered again with another layout). It is what was asked:
    # vLLM 0.26 also needs one attention group, and under MultiConnector every child asking,
    # before it allocates the buffer (docs/vllm.md).
    cross = "cross-layer" if wants_cross_layer(cfg.layout, vllm_layouts()) else "per-layer"
    pc = vllm_config.parallel_config
    return fingerprint(
        model,
        facts.identity if isinstance(facts, GroupFacts) else facts,
        str(getattr(vllm_config.cache_config, "cache_dtype", None)),
        str(layout),
        cross,
        pc.tensor_parallel_size,
        pc.pipeline_parallel_size,
        g,
        tuple(group.layer_names),
    )


class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads KV cache to kvd, the native KV-cache offload server."""

    # kvd's hits come from host memory: vllm:prompt_tokens_cached_by_source{source="host"}.
    _cache_hit_source = _CacheHitSource.HOST if _CacheHitSource is not None else None

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._cfg = KvdConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
            raise ValueError("KvdConnector needs vLLM's KV cache config (vLLM >= 0.26)")
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning(
                "kvd: kv_load_failure_policy is %r; a chunk evicted between lookup and load then fails "
                "its request. Set \"kv_load_failure_policy\":\"recompute\" so vLLM recomputes instead.",
                self._kv_transfer_config.kv_load_failure_policy,
            )
        tp_rank, tp, pp_rank, pp = _ranks(vllm_config)
        groups = kv_cache_config.kv_cache_groups
        self._layer_groups = [list(g.layer_names) for g in groups]
        engine = self._kv_transfer_config.engine_id
        self._sched: KvdScheduler | None = None
        self._worker: KvdWorker | None = None
        self._requests: dict[str, "Request"] = {}
        self._blocks: dict[str, list[list[int]]] = {}
        self._awaiting_send: set[str] = set()
        self._events: vllm_events.SchedulerEvents | None = None
        self._stats_reported = False
        #: The lookup totals last seen, and how many more steps report them (kvd.vllm_stats).
        self._totals_seen: dict[str, int] = {}
        self._totals_resend = 0
        facts = [group_facts(g.kv_cache_spec, getattr(g, "enable_kv_transfer", True)) for g in groups]
        #: Why kvd stays off for this model (None when it serves): said once, at start.
        self.disabled = unsupported(facts)
        if self.disabled is not None:
            if role == KVConnectorRole.SCHEDULER:
                log.error("kvd: offloading is off for this model, vLLM serves without it: %s", self.disabled)
            return
        known = [f for f in facts if isinstance(f, GroupFacts)]
        if role == KVConnectorRole.SCHEDULER:
            infos = []
            for g, (group, f) in enumerate(zip(groups, known)):
                shards = tuple(p * tp for p in range(pp)) if f.mla else tuple(range(pp * tp))
                infos.append(GroupInfo(
                    fingerprint=_group_fingerprint(vllm_config, self._cfg, g, group),
                    block_tokens=f.block_tokens,
                    shards=shards,
                    readers=tp if f.mla else 1,
                    sliding=f.kind == "sliding",
                    window=f.window,
                    ignored=f.kind == "ignored",
                    state=f.kind == "state",
                ))
            conn = Connection(self._cfg, f"vllm-scheduler-{engine}", "scheduler")
            self._sched = KvdScheduler(self._cfg, infos, conn)
            if self._sched.overlap_loads and (why := _no_overlap(vllm_config)):
                log.info("kvd: loads wait for the model's stream (%s)", why)
                self._sched.overlap_loads = False
            self._events = (
                vllm_events.SchedulerEvents(kv_cache_config, infos, vllm_config.cache_config.block_size)
                if vllm_events.enabled(vllm_config) else None
            )
        else:
            wgroups = []
            for g, (group, f) in enumerate(zip(groups, known)):
                shard = pp_rank * tp + (0 if f.mla else tp_rank)
                wgroups.append(WorkerGroup(
                    fingerprint=_group_fingerprint(vllm_config, self._cfg, g, group),
                    shard=shard,
                    store=not f.mla or tp_rank == 0,
                    sliding=f.kind == "sliding",
                    block_tokens=f.block_tokens,
                    ignored=f.kind == "ignored",
                    state=f.kind == "state",
                    window=f.window,
                ))
            conn = Connection(self._cfg, f"vllm-worker-{engine}-tp{tp_rank}-pp{pp_rank}-pid{os.getpid()}", "worker")
            self._worker = KvdWorker(self._cfg, conn, wgroups, current_stream=_current_stream)
            self._worker.report_stored = vllm_events.enabled(vllm_config)

    # ------------------------------------------------------------------ class-level settings

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config if vllm_config.kv_transfer_config else {}
        return required_layout(KvdConfig.from_extra_config(extra).layout, vllm_layouts())

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        # vLLM < 0.33 knows no block-outermost layout names, but gives a connector that prefers
        # it one cross-layer buffer with blocks outermost (NHD: BLNHC in kvd's terms).
        return wants_cross_layer(self._cfg.layout, vllm_layouts())

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a preempted request may simply be recomputed.
        return False

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = request

    def _sched_request(self, request: "Request") -> SchedRequest:
        spans = []
        for f in getattr(request, "mm_features", None) or []:
            pos = getattr(f, "mm_position", None)
            ident = getattr(f, "identifier", None) or getattr(f, "mm_hash", None)
            if pos is not None and ident is not None:
                spans.append(Span(int(pos.offset), int(pos.length), str(ident).encode()))
        lora = getattr(request, "lora_request", None)
        return SchedRequest(
            req_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            salt=salt_hash(getattr(request, "cache_salt", None)),
            spans=spans,
            namespace=(lora.lora_name, getattr(lora, "lora_path", None)) if lora is not None else None,
            cacheable=getattr(request, "prompt_embeds", None) is None,
        )

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._sched is None:
            return 0, False
        self._requests[request.request_id] = request
        return self._sched.get_num_new_matched_tokens(self._sched_request(request), num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: Any, num_external_tokens: int) -> None:
        if self._sched is None:
            return
        block_ids = [list(b) for b in blocks.get_block_ids()]
        self._blocks[request.request_id] = block_ids
        self._sched.update_state_after_alloc(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if self._sched is None:
            return KvdConnectorMetadata(KvdMetadata())
        scheduled: list[tuple[SchedRequest, int, int, list[list[int]] | None]] = []
        for new in scheduler_output.scheduled_new_reqs:
            req = self._requests.get(new.req_id)
            if req is None:
                continue
            self._blocks[new.req_id] = [list(b) for b in new.block_ids]
            n = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
            scheduled.append((self._sched_request(req), new.num_computed_tokens, n, self._blocks[new.req_id]))
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in resumed or req_id not in self._blocks:
                    self._blocks[req_id] = [list(b) for b in new_ids]
                else:
                    for g, b in enumerate(new_ids):
                        self._blocks[req_id][g].extend(b)
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            scheduled.append((self._sched_request(req), cached.num_computed_tokens[i], n, self._blocks.get(req_id)))
        preempted = sorted(getattr(scheduler_output, "preempted_req_ids", None) or ())
        meta = self._sched.build(scheduled, preempted, _written_before_forward(scheduler_output))
        if self._events is not None:
            self._events.planned(meta.stores, self._requests, self._sched.chunk_tokens)
        self._awaiting_send.update(meta.delayed)
        return KvdConnectorMetadata(meta)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if self._sched is None:
            return False, None
        self._requests.pop(request.request_id, None)
        # vLLM names only the blocks of computed tokens; those the scheduler output gave the
        # request hold its lookahead slots too (speculative decoding).
        self._sched.blocks_freed(self._blocks.pop(request.request_id, []))
        self._sched.blocks_freed(block_ids)
        if self._sched.config.warm_group and _rememberable(request):
            self._sched.remember(request.prompt_token_ids, getattr(request, "cache_salt", None))
        return self._sched.request_finished(request.request_id), None

    def update_connector_output(self, connector_output: Any) -> None:
        sent = getattr(connector_output, "finished_sending", None) or set()
        self._awaiting_send.difference_update(sent)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, vllm_events.KvdWorkerMetadata):
            meta = None
        if self._sched is not None:
            # The workers name the chunks that failed; failed_recving (vLLM >= 0.33) only the
            # request, taken as its whole load where no worker said more.
            failed = dict(meta.failed) if meta is not None else {}
            for req_id in getattr(connector_output, "failed_recving", None) or ():
                failed.setdefault(req_id, frozenset())
            for req_id, chunks in failed.items():
                self._sched.load_failed(req_id, chunks)
            if meta is not None and meta.subs:
                self._sched.set_subs(meta.subs)
            if meta is not None and meta.ready is not None:
                self._sched.set_workers_ready(meta.ready)
        if self._events is not None:
            self._events.on_output(connector_output)

    def has_pending_push_work(self) -> bool:
        # Keep vLLM stepping while delayed block frees wait for their stores.
        return bool(self._awaiting_send)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        if self._worker is None:
            return
        views_per_group = []
        for names in self._layer_groups:
            seen: set[int] = set()
            views = []
            for name in names:
                t = kv_caches.get(name)
                # A state layer may come as its state tensors (vLLM < 0.33: conv, then SSM).
                for v in (t if isinstance(t, (list, tuple)) else [t]):
                    if v is None or v.data_ptr() in seen:  # KV-sharing layers alias their target
                        continue
                    seen.add(v.data_ptr())
                    views.append(v)
            views_per_group.append(views)
        self._register(views_per_group)

    def _register(self, views_per_group: list[list[Any]]) -> None:
        try:
            self._worker.register(views_per_group)  # type: ignore[union-attr]
        except LayoutError as e:
            # The worker stays, registering nothing: its loads fail (vLLM recomputes) and its
            # delayed frees complete, so vLLM serves on without offloading.
            log.error("kvd: offloading is off for this model, vLLM serves without it: %s", e)

    def register_cross_layers_kv_cache(self, kv_cache: "torch.Tensor", attn_backend: Any) -> None:
        """vLLM < 0.33 with ``prefer_cross_layer_blocks``: one tensor for every layer, in the
        backend's physical order; the per-layer views are taken back in logical order."""
        if self._worker is None:
            return
        try:
            order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
        except (AttributeError, NotImplementedError):
            order = tuple(range(kv_cache.dim()))
        logical = kv_cache.permute(*[order.index(i) for i in range(len(order))])
        self._register([[logical[i] for i in range(logical.shape[0])]])

    def unregister_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.unregister()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.restore()

    def _meta(self) -> KvdMetadata:
        m = self._get_connector_metadata()
        return m.inner if isinstance(m, KvdConnectorMetadata) else KvdMetadata()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KvdConnectorMetadata):
            self._worker.handle_preemptions(kv_connector_metadata.inner)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        # vLLM >= 0.33 starts loads after launching the forward pass (unless the step has sync
        # loads): what must precede the forward happens here, the last call before it.
        if self._worker is not None and isinstance(connector_metadata, KvdConnectorMetadata):
            self._worker.before_forward(connector_metadata.inner)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: vLLM schedules a request only after get_finished reports it.
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        # Whole chunks of all layers are stored after the forward pass, in wait_for_save.
        return None

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        sending, recving = self._worker.get_finished()
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        sending, recving = self.get_finished(finished_req_ids)
        if KVConnectorTransferResults is None:  # pragma: no cover
            return sending, recving
        failed = self._worker.failed_loads() if self._worker is not None else set()
        # One group: the blocks that failed (get_block_ids_with_load_errors) tell vLLM more, so
        # it keeps the prefix that loaded. Several: only the request can be named, and vLLM
        # recomputes it from its start.
        return KVConnectorTransferResults(
            finished_sending=sending or set(),
            finished_recving=recving or set(),
            failed_recving=failed if len(self._layer_groups) > 1 else set(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors = self._worker.load_errors() if self._worker is not None else set()
        if len(self._layer_groups) > 1 and errors:
            # Block ids are unique only within a group. vLLM >= 0.33 refuses them (RuntimeError)
            # for a model of several groups and takes the failed requests (get_transfer_results'
            # failed_recving) instead, recomputing each from its start. vLLM < 0.33 has no such
            # report and crashes on block ids of several groups (it unpacks one group's), so
            # nothing is reported there: the request runs on with what its blocks hold.
            if KVConnectorTransferResults is None:
                log.error("kvd: a load failed and this vLLM (< 0.33) cannot be told for a model of %d KV cache "
                          "groups; the request continues on unloaded blocks. Upgrade to vLLM >= 0.33, which "
                          "recomputes it", len(self._layer_groups))
            return set()
        return errors

    # ------------------------------------------------------------------ observability

    def take_events(self) -> list[Any]:
        """vLLM's KV events for kvd's tier (empty unless vLLM publishes KV events)."""
        if self._events is None or self._sched is None:
            return []
        return self._events.take(self._sched.conn.client() if self._sched.conn is not None else None)

    def build_connector_worker_meta(self) -> Any:
        """Each step: the registrations per group (the scheduler's lookups must ask every one),
        the chunks whose loads failed, whether this rank can load now (the scheduler offers no
        hit while a rank cannot: its load would fail and vLLM recompute), and, with KV events
        on, the keys of chunks this rank's stores put in kvd."""
        if self._worker is None:
            return None
        stored = self._worker.take_stored() if self._worker.report_stored else []
        failed = {r: frozenset(c) for r, c in self._worker.take_failed_chunks().items()}
        return vllm_events.KvdWorkerMetadata(stored, tuple(self._worker.subs), failed, self._worker.ready())

    def get_kv_connector_stats(self) -> Any:
        """A worker's finished transfers; the scheduler's lookups (sent, answered from the
        presence filter, answered "ask again", timed out) since its last report, with their
        totals for ``RESEND_STEPS`` steps after they last moved, and at its first step a report
        that creates every series at zero."""
        if self._worker is not None:
            return vllm_stats.worker_stats(self._worker.take_stats())
        first, self._stats_reported = not self._stats_reported, True
        totals = self._sched.lookup_totals() if self._sched is not None else {}
        grew = {k: v - self._totals_seen.get(k, 0) for k, v in totals.items()}
        if any(grew.values()):
            self._totals_seen = totals
            self._totals_resend = vllm_stats.RESEND_STEPS
        if not first and self._totals_resend <= 0:
            return None
        self._totals_resend -= 1
        return vllm_stats.scheduler_stats(grew, totals, first)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return vllm_stats.KvdConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> Any:
        return vllm_stats.KvdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None and self._sched.conn is not None:
            self._sched.conn.close()


def _rememberable(request: "Request") -> bool:
    """Whether a finished request's prompt is worth a replacement's warm:
    - its prompt was computed: it has output, or its computed tokens cover the prompt (a request
      aborted while waiting has neither; one finished by an in-flight step after a preemption
      reset its computed tokens has output);
    - replaying its token ids alone recreates its KV: not for prompt embeddings, multimodal
      inputs or a LoRA adapter;
    - it is not a warm's own replay (``kv_transfer_params`` ``{"kvd.warm": true}``), which would
      make the prompt look newer than the traffic that sent it and keep it past ``--max-age``."""
    prompt = getattr(request, "prompt_token_ids", None)
    params = getattr(request, "kv_transfer_params", None)
    return (prompt is not None
            and (getattr(request, "num_output_tokens", 0) > 0 or getattr(request, "num_computed_tokens", 0) >= len(prompt))
            and not (isinstance(params, dict) and params.get(WARM_PARAM))
            and getattr(request, "prompt_embeds", None) is None
            and not getattr(request, "mm_features", None)
            and getattr(request, "lora_request", None) is None)


def vllm_layouts() -> frozenset[str]:
    """The KV layout names the running vLLM accepts: its ``KVCacheLayout`` members (0.33), or
    ``NHD``/``HND`` (0.26, which has no such enum and refuses other names at start)."""
    try:
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:
        return frozenset(("NHD", "HND"))
    return frozenset(m.name for m in KVCacheLayout)


def required_layout(configured: str, known: frozenset[str]) -> str | None:
    """The layout to ask vLLM for: the configured one where vLLM knows it, else none (vLLM's
    default; a block-outermost choice then comes through cross-layer blocks). ``auto`` is
    ``BLNHC`` where vLLM takes it by name (0.33), else vLLM's own (0.26, whose only
    block-outermost buffer slowed the model's steps). An explicit name this vLLM does not know
    is logged, not passed on: vLLM would refuse to start."""
    c = configured.upper()
    if c == "AUTO":
        return "BLNHC" if "BLNHC" in known else None
    if c in ("NONE", ""):
        return None
    if c in known:
        return c
    if not c.startswith("B"):
        log.warning("kvd: this vLLM knows the KV layouts %s, not %r; leaving the layout to vLLM",
                    ", ".join(sorted(known)), configured)
    return None


def wants_cross_layer(configured: str, known: frozenset[str]) -> bool:
    """Whether to ask for vLLM's cross-layer blocks: a block-outermost layout was configured by
    name and this vLLM cannot be asked for it by name (``auto`` never asks)."""
    c = configured.upper()
    return c.startswith("B") and c not in known


def _no_overlap(vllm_config: Any) -> str | None:
    """Why loads may not start beside the running forward pass under this configuration (None:
    they may, ``KvdConfig.load_overlap``). vLLM defers a freed block's return only for a
    connector that loads (its role), and with a drafter (which may still write a finished
    request's lookahead blocks after the step's output is processed) or several pipeline
    stages, more steps than the connector's two-plan margin can be in flight."""
    kt = getattr(vllm_config, "kv_transfer_config", None)
    if getattr(kt, "kv_role", "kv_both") not in ("kv_both", "kv_consumer"):
        return f"kv_role {getattr(kt, 'kv_role', None)!r}"
    if getattr(vllm_config, "speculative_config", None) is not None:
        return "speculative decoding"
    pp = getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1)
    if isinstance(pp, int) and pp > 1:
        return f"pipeline_parallel_size {pp}"
    return None


def _written_before_forward(scheduler_output: Any) -> set[int] | None:
    """Blocks the workers write on the model's stream before this step's forward pass (0.26 and
    0.33): the new blocks vLLM zeroes (models with Mamba layers) and the destinations of its
    copy-on-write copies (a prefix hit that ends inside a block). A load into one of them must
    wait for the model's stream, or vLLM's write would land on kvd's. None: a copy whose
    destination cannot be read (every load of the step waits)."""
    written = set(getattr(scheduler_output, "new_block_ids_to_zero", None) or ())
    for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
        dst = getattr(copy, "dst_block_id", None)
        if not isinstance(dst, int):
            return None
        written.add(dst)
    return written


def _current_stream() -> int:
    import torch

    return int(torch.cuda.current_stream().cuda_stream)
