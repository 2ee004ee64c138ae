"""Settings of the kvd connector, read from vLLM's ``kv_connector_extra_config``.

Every key is optional; the defaults suit one kvd per node on its default port.
"""

from __future__ import annotations

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
    #: Seconds a load may take before it is reported failed (vLLM then recomputes).
    load_timeout_s: float = 30.0
    #: First and longest wait between reconnection attempts, in seconds.
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    #: KV layout to ask vLLM for: BLNHC (block-outermost: one DMA descriptor per block of all
    #: layers), another of vLLM's names, or "none" to leave the choice to vLLM.
    layout: str = "BLNHC"
    #: Store prompt chunks into kvd.
    store: bool = True
    #: Also store chunks of generated tokens (multi-turn reuse of answers).
    store_generated: bool = False
    #: Load hits from kvd.
    load: bool = True
    #: Interprocess event slots per registration.
    events: int = 64
    #: Tokens per chunk before kvd has said (kvd's --chunk-tokens wins once connected).
    chunk_tokens: int = 256
    #: Overrides the model identity used in keys (default: model name and revision).
    model_id: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "KvdConfig":
        """Reads ``kvd.*`` keys (and unprefixed ones); unknown ``kvd.*`` keys are an error, so
        that a misspelt setting is not silently ignored."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in extra.items():
            name = key[4:] if key.startswith("kvd.") else key
            name = name.replace("-", "_").replace(".", "_")
            if name not in known:
                if key.startswith("kvd."):
                    raise ValueError(
                        f"unknown kv_connector_extra_config key {key!r}; known keys: "
                        + ", ".join(f"kvd.{n}" for n in known)
                    )
                continue
            f = known[name]
            values[name] = _coerce(key, value, f.type)
        return cls(**values)


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
            return None
        return str(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"kv_connector_extra_config {key!r}: bad value {value!r} ({typ})") from e
