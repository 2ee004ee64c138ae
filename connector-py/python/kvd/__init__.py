"""kvd: the vLLM KV connector for kvd, the native KV-cache offload server.

``import kvd`` imports neither vLLM nor torch. The vLLM-facing class is ``kvd.vllm.KvdConnector``
(load it with ``kv_connector_module_path="kvd.vllm"``); it is a thin adapter over the
vLLM-independent ``KvdScheduler`` and ``KvdWorker`` here.
"""

from kvd._native import (
    ALREADY_STORED,
    LOADED,
    MISSING,
    PROTOCOL_VERSION,
    REFUSED_POOL_FULL,
    SKIPPED,
    STORED,
    Busy,
    Client,
    ConnectionLost,
    TimedOut,
    DeviceError,
    HostBuffer,
    KvdError,
    NotReady,
    Expired,
    Pending,
    Registration,
    ServerError,
    VmmMemoryError,
    __version__,
    chunk_hashes,
    cuda_available,
)
from kvd.config import KvdConfig
from kvd.connection import Connection
from kvd.keys import ChunkHasher, Span, fingerprint, salt_hash
from kvd.layout import KvLayoutSpec, LayoutError, describe
from kvd.metadata import SKIP, KvdMetadata, LoadOp, StoreOp
from kvd.scheduler import GroupInfo, KvdScheduler, SchedRequest
from kvd.worker import KvdWorker, WorkerGroup

__all__ = [
    "ALREADY_STORED",
    "LOADED",
    "MISSING",
    "PROTOCOL_VERSION",
    "REFUSED_POOL_FULL",
    "SKIP",
    "SKIPPED",
    "STORED",
    "Busy",
    "ChunkHasher",
    "Client",
    "Connection",
    "ConnectionLost",
    "TimedOut",
    "DeviceError",
    "GroupInfo",
    "HostBuffer",
    "KvLayoutSpec",
    "KvdConfig",
    "KvdError",
    "NotReady",
    "Expired",
    "KvdMetadata",
    "KvdScheduler",
    "KvdWorker",
    "LayoutError",
    "LoadOp",
    "Pending",
    "Registration",
    "SchedRequest",
    "ServerError",
    "Span",
    "StoreOp",
    "VmmMemoryError",
    "WorkerGroup",
    "__version__",
    "chunk_hashes",
    "cuda_available",
    "describe",
    "fingerprint",
    "salt_hash",
]
