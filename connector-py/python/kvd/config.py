"""Settings of the kvd connector, read from vLLM's ``kv_connector_extra_config``.

Every key is optional; the defaults suit one kvd per node on its default port.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Mapping


@dataclass(frozen=True)
class KvdConfig:
    """Connector settings. Field ``x_y`` is the extra-config key ``kvd.x_y``."""

    #: kvd's ZMQ endpoint.
    url: str = "tcp://127.0.0.1:5555"
    #: Overrides the fd socket path kvd announces (when vLLM sees it under another path).
    fd_socket: str | None = None
    #: Seconds to connect and say hello.
    connect_timeout_s: float = 2.0
    #: Seconds to wait for any reply before treating kvd as gone.
    request_timeout_s: float = 10.0
    #: Seconds a lookup may take before the request proceeds as a miss.
    lookup_timeout_s: float = 2.0
    #: Seconds vLLM's scheduler waits for a lookup it just sent before answering "ask again".
    #: kvd answers in ~50-100 us; without the wait every request lost one engine step (15 ms of
    #: TTFT at low load on the H200, benches/RESULTS.md).
    lookup_wait_s: float = 0.002
    #: Seconds a load may take before it is reported failed (vLLM then recomputes; at most
    #: ``request_timeout_s`` in effect). kvd is told (a deadline in the retrieve) and never
    #: starts the copy later, so blocks vLLM gave up on are never written after they went to
    #: other work.
    load_timeout_s: float = 30.0
    #: How a hit is loaded. "sync": vLLM schedules the request at once, and its forward pass
    #: waits on the GPU for kvd's copy (no engine step is spent waiting); "async": vLLM parks
    #: the request until the copy is done and schedules it a step later; "auto": sync for a
    #: model of one KV cache group, async for several (vLLM can be told which blocks of a
    #: running request failed to load only for one group; and within ``sync_load_tokens``).
    load_mode: str = "auto"
    #: With ``load_mode`` auto, the most tokens a step loads synchronously; None: no limit. A
    #: synchronous load holds the step's whole forward pass, every running request's next token
    #: included, for its copy; hits past this many in one step (a burst, a restarted engine's
    #: conversations coming back at once) load asynchronously, each request joining the batch
    #: as its own copy is done. 0: every hit asynchronously. No limit by default: on an H100,
    #: 8192 cut a restarted engine's first turn to 0.77x and raised four busy engines' TTFT p50
    #: ~1.35x (docs/vllm.md, benches/results/2026-12-06-session-30.md).
    sync_load_tokens: int | None = None
    #: Seconds a synchronous load holds the step's forward pass for kvd's answer; past it the
    #: load fails (kvd starts no copy after it) and vLLM recomputes those tokens.
    sync_load_timeout_s: float = 0.5
    #: Seconds kvd has to start copying a store. vLLM may reuse a sliding window's blocks (and a
    #: preempted request's) in the next step: that step's forward waits for kvd's answer until
    #: this deadline (and ``kvd.worker.COPY_GRACE_S``), and kvd never starts the copy later, so
    #: a lagging or stopped kvd costs hits, never bytes.
    store_deadline_s: float = 2.0
    #: First and longest wait between reconnection attempts, in seconds.
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    #: KV layout to ask vLLM for. "auto": BLNHC (block-outermost: one DMA descriptor per block
    #: of all layers) where vLLM takes it by name (0.33), else vLLM's own per-layer layout (0.26,
    #: whose cross-layer buffer, its only block-outermost one, slowed the Llama-8B shape's steps
    #: by 3-5%, docs/vllm.md). "none": always vLLM's own. Or one of vLLM's names (BLNHC on 0.26
    #: asks for the cross-layer buffer, which only its V1 model runner gives).
    layout: str = "auto"
    #: Store prompt chunks into kvd.
    store: bool = True
    #: Also store chunks of generated tokens (multi-turn reuse of answers).
    store_generated: bool = False
    #: Load hits from kvd.
    load: bool = True
    #: Answer a lookup that cannot find more than vLLM's own prefix cache holds from kvd's
    #: presence filter (a shared-memory file on kvd's host) without waiting for kvd's reply;
    #: kvd still hears of the prompt. Off: every lookup waits for kvd.
    presence: bool = True
    #: Start a load's copy at once, beside the forward pass vLLM's asynchronous scheduling still
    #: runs on the GPU, where none of the load's blocks can be in that pass's use: a model of
    #: full-attention groups only, a loading role, no drafter and one pipeline stage; no
    #: preemption in this or the last scheduling step, no block of the load freed by vLLM in
    #: them or written by vLLM before this step's forward (zeroing, copy-on-write). Otherwise
    #: (and with False) kvd's copy waits for the model's stream first, and a synchronous load's
    #: step waits for that pass and the copy one after the other (docs/vllm.md, "A load beside
    #: the running step").
    load_overlap: bool = True
    #: Interprocess event slots per registration.
    events: int = 64
    #: Tokens per chunk before kvd has said (kvd's --chunk-tokens wins once connected).
    chunk_tokens: int = 256
    #: Overrides the model identity used in keys (default: model name and revision).
    model_id: str | None = None
    #: The replica's name, the same across its restarts (a StatefulSet pod's name, "node3-gpu0"):
    #: set, every prompt this engine finishes is remembered in kvd under it (kvd's --recall-mb),
    #: so that a replacement can be warmed from kvd before it takes traffic (``python -m
    #: kvd.warm``, docs/vllm.md). None: nothing is remembered.
    warm_group: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "KvdConfig":
        """Reads ``kvd.*`` keys (and unprefixed ones); unknown ``kvd.*`` keys are an error, so
        that a misspelt setting is not silently ignored."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        keys: dict[str, str] = {}
        for key, value in extra.items():
            name = key[4:] if key.startswith("kvd.") else key
            name = name.replace("-", "_").replace(".", "_")
            if name not in known:
                if key.startswith("kvd."):
                    raise ValueError(
                        f"unknown kv_connector_extra_config key {_shown(key)}; known keys: "
                        + ", ".join(f"kvd.{n}" for n in known)
                    )
                continue
            f = known[name]
            values[name] = _check(key, name, _coerce(key, value, f.type))
            keys[name] = key
        lo = values.get("reconnect_min_s", cls.reconnect_min_s)
        hi = values.get("reconnect_max_s", cls.reconnect_max_s)
        if lo > hi:
            named = " and ".join(_shown(keys[n]) for n in ("reconnect_min_s", "reconnect_max_s") if n in keys)
            raise ValueError(
                f"kv_connector_extra_config {named}: reconnect_min_s {lo} is above reconnect_max_s {hi}; "
                "make the first wait the shorter one"
            )
        return cls(**values)


def _check(key: str, name: str, value: Any) -> Any:
    """Refuses values the connector cannot work with: waits must be finite and above zero (a NaN
    or negative timeout never fires or always does), counts at least one."""
    if name.endswith("_s") and not (math.isfinite(value) and value > 0):
        raise ValueError(f"kv_connector_extra_config {_shown(key)}: {value!r} is not a positive number of seconds")
    if name == "load_mode" and value not in ("auto", "sync", "async"):
        raise ValueError(f"kv_connector_extra_config {_shown(key)}: {_shown(value)} is not one of auto, sync, async")
    if name in ("events", "chunk_tokens") and value < 1:
        raise ValueError(f"kv_connector_extra_config {_shown(key)}: {value!r} must be 1 or more")
    if name == "warm_group" and value is not None and not 1 <= len(value.encode()) <= 256:
        raise ValueError(f"kv_connector_extra_config {_shown(key)}: name the replica in 1 to 256 bytes")
    if name == "sync_load_tokens" and value is not None and value < 0:
        raise ValueError(f"kv_connector_extra_config {_shown(key)}: {value!r} must be 0 (every hit asynchronously) or more")
    return value


def _coerce(key: str, value: Any, typ: Any) -> Any:
    t = str(typ)
    try:
        if "bool" in t:
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if "float" in t:
            return float(value)
        if t == "int" or "int" in t.split("|")[0]:
            return int(value)
        if value is None:
            if "None" in t:
                return None
            raise ValueError("null")
        return str(value)
    except (TypeError, ValueError, OverflowError) as e:  # int(inf) raises OverflowError
        raise ValueError(f"kv_connector_extra_config {_shown(key)}: bad value {_shown(value)} ({typ})") from e


def _shown(value: Any) -> str:
    """A value's repr cut to 80 characters, so that an error naming it stays one short line."""
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."
