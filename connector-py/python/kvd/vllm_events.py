"""vLLM's side of kvd's KV events (the rules are in ``kvd.events``, which knows no vLLM).

- scheduler: ``SchedulerEvents`` snapshots planned stores with the vLLM request's block hashes,
  takes the workers' reports from ``KVConnectorOutput.kv_connector_worker_meta`` and kvd's
  eviction feed, and builds vLLM's ``BlockStored`` / ``BlockRemoved`` for ``take_events``;
- worker: ``KvdWorkerMetadata`` carries the keys of the chunks each rank's stores put in kvd to
  the scheduler; vLLM joins the ranks' with ``aggregate``.

Both are inert unless vLLM publishes KV events (``--kv-events-config`` with
``enable_kv_cache_events``): nothing is tracked or sent otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvd.events import EventGroup, EventRequest, EvictionFeed, KvEvents
from kvd.metadata import StoreOp
from kvd.scheduler import GroupInfo

try:  # vLLM >= 0.33: hashes at a group's block size when it differs from the hash block size
    from vllm.v1.core.kv_cache_utils import resolve_block_hashes as _resolve
except ImportError:  # pragma: no cover - older vLLM
    _resolve = None


def enabled(vllm_config: Any) -> bool:
    """Whether this vLLM publishes KV cache events."""
    c = getattr(vllm_config, "kv_events_config", None)
    return bool(c is not None and c.enable_kv_cache_events)


def _kind(spec: Any) -> tuple[str | None, int | None]:
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

        return get_kv_cache_spec_kind(spec).value, get_kv_cache_spec_sliding_window(spec)
    except ImportError:  # pragma: no cover - older vLLM: guess from the class name
        name = type(spec).__name__
        window = getattr(spec, "sliding_window", None)
        if window is not None:
            return "sliding_window", window
        return ("mla_attention" if "MLA" in name else "full_attention" if "FullAttention" in name else None), None


@dataclass
class KvdWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler side each step: (group, salt, shard, chunk hash) of
    the chunks the ranks' stores put in kvd, the registrations per group (a group of layers
    of several shapes is several registrations, which every lookup must ask), and per request
    the hashes of the chunks a load could not bring, in any group; and whether every rank can
    load now (connected to kvd, every registration in place), None where a rank did not say."""

    stored: list[tuple[int, int, int, int]] = field(default_factory=list)
    subs: tuple[int, ...] = ()
    failed: dict[str, frozenset[int]] = field(default_factory=dict)
    ready: bool | None = None

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvdWorkerMetadata":
        if isinstance(other, KvdWorkerMetadata):
            # Every rank has the same layer shapes; the widest answer wins if one is starting.
            subs = self.subs if sum(self.subs) >= sum(other.subs) else other.subs
            failed = dict(self.failed)
            for req_id, chunks in other.failed.items():
                failed[req_id] = failed.get(req_id, frozenset()) | chunks
            # A hit needs every rank: one that cannot load makes the step's answer "not ready".
            said = [r for r in (self.ready, other.ready) if r is not None]
            ready = all(said) if said else None
            return KvdWorkerMetadata(self.stored + other.stored, subs, failed, ready)
        return self


class SchedulerEvents:
    """The scheduler's KV event tracker for kvd's tier."""

    def __init__(self, kv_cache_config: Any, groups: Sequence[GroupInfo], block_size: int) -> None:
        self._kv_cache_config = kv_cache_config
        self._block_size = block_size
        egroups = []
        for info, group in zip(groups, kv_cache_config.kv_cache_groups):
            kind, window = _kind(group.kv_cache_spec)
            egroups.append(EventGroup(info.fingerprint, info.block_tokens, info.shards, kind, window))
        self.events = KvEvents(egroups)
        self.feed = EvictionFeed()

    def _hash_block_size(self) -> int:
        # Set by vLLM >= 0.33's engine core once the cache is planned; before, the block size.
        return int(getattr(self._kv_cache_config, "hash_block_size", None) or self._block_size)

    def planned(self, stores: Sequence[StoreOp], requests: Mapping[str, Any], chunk_tokens: int) -> None:
        """Snapshots the step's planned stores while vLLM's requests are at hand."""
        hbs = self._hash_block_size()
        for op in stores:
            req = requests.get(op.req_id)
            if req is None:
                continue
            raw = req.block_hashes
            per_group = []
            for g in self.events.groups:
                if g.block_tokens == hbs or _resolve is None:
                    per_group.append(raw if g.block_tokens == hbs else [])
                else:
                    per_group.append(list(_resolve(raw, hbs, g.block_tokens)))
            lora = getattr(req, "lora_request", None)
            er = EventRequest(
                token_ids=req.all_token_ids,
                block_hashes=per_group,
                lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
                lora_name=getattr(lora, "name", None) if lora is not None else None,
            )
            self.events.planned(er, op.salt, chunk_tokens, op.first_chunk, [[h for h, _ in chunks] for chunks in op.groups])

    def on_output(self, connector_output: Any) -> None:
        """The workers' reports of a step (vLLM's aggregated worker metadata)."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvdWorkerMetadata):
            self.events.stored(meta.stored)

    def take(self, client: Any) -> list[Any]:
        """vLLM's events since the last call; reads kvd's eviction feed on the way."""
        self.feed.poll(client, self.events)
        return self.events.take(BlockStored, BlockRemoved, maybe_convert_block_hash)
