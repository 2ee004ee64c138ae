"""Type stubs of kvd's native module. scripts/test.sh checks them against the built module with
mypy's stubtest (names both ways, ``__all__``, signatures; it needs no allowlist) and
tests/test_native.py checks what stubtest cannot see, the types of returned values.

Native classes cannot be subclassed, hence ``@final``; their constructors are ``__new__`` (pyo3's
``#[new]``). The dicts the module returns are ``TypedDict``s here and plain dicts at runtime. A
new native name goes in ``__all__`` too: pyo3 lists every added name there.
"""

from typing import Generic, Sequence, TypedDict, TypeVar, final

__all__ = [
    "__version__",
    "PROTOCOL_VERSION",
    "STORED",
    "ALREADY_STORED",
    "REFUSED_POOL_FULL",
    "SKIPPED",
    "LOADED",
    "MISSING",
    "SKIP",
    "KvdError",
    "ConnectionLost",
    "TimedOut",
    "ServerError",
    "Busy",
    "NotReady",
    "Expired",
    "VmmMemoryError",
    "DeviceError",
    "Client",
    "Pending",
    "Registration",
    "HostBuffer",
    "chunk_hashes",
    "cuda_available",
    "gpu_available",
    "describe_pointer",
    "device_memory",
]

__version__: str
PROTOCOL_VERSION: int
STORED: int
ALREADY_STORED: int
REFUSED_POOL_FULL: int
SKIPPED: int
LOADED: int
MISSING: int
SKIP: int

class KvdError(Exception): ...
class ConnectionLost(KvdError): ...
class TimedOut(ConnectionLost): ...
class ServerError(KvdError): ...
class Busy(ServerError): ...
class NotReady(ServerError): ...
class Expired(ServerError): ...
class VmmMemoryError(KvdError): ...
class DeviceError(KvdError): ...

def chunk_hashes(
    tokens: Sequence[int],
    chunk_tokens: int,
    extras: Sequence[tuple[int, int, bytes]] = ...,
    seed: int = 0,
) -> list[int]: ...
def cuda_available() -> tuple[bool, str]: ...
def gpu_available(api: str) -> tuple[bool, str]: ...

class _PointerInfo(TypedDict):
    base: int
    alloc_bytes: int
    offset: int
    ordinal: int
    uuid: str
    legacy_ipc: bool

def describe_pointer(ptr: int, api: str = "cuda") -> _PointerInfo: ...
def device_memory(ordinal: int, api: str = "cuda") -> tuple[int, int]: ...

_T_co = TypeVar("_T_co", covariant=True)

# Generic only here: the runtime class is not subscriptable, so annotations that name
# Pending[...] must not be evaluated (every kvd module has `from __future__ import annotations`).
@final
class Pending(Generic[_T_co]):
    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> _T_co: ...

@final
class Registration:
    @property
    def region(self) -> int: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def chunk_blocks(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def ordinal(self) -> int: ...
    @property
    def shared_by(self) -> str: ...
    @property
    def num_events(self) -> int: ...
    def record(self, slot: int, stream: int) -> None: ...
    def query(self, slot: int) -> bool: ...
    def stream_wait(self, slot: int, stream: int) -> None: ...
    def synchronize(self, slot: int) -> None: ...

@final
class HostBuffer:
    def __new__(cls, size: int) -> HostBuffer: ...
    @property
    def ptr(self) -> int: ...
    @property
    def size(self) -> int: ...
    def read(self, offset: int, length: int) -> bytes: ...
    def write(self, offset: int, data: bytes) -> None: ...
    def fill_random(self, seed: int) -> None: ...

class _ServerHello(TypedDict):
    chunk_tokens: int
    fd_socket: str
    session_timeout_ms: int
    server_version: str
    session_id: int
    protocol_version: int
    presence: str
    max_frame_bytes: int

class _Stats(TypedDict):
    pool_bytes_total: int
    pool_bytes_used: int
    chunks: int
    pinned_pages: int
    sessions: int
    regions: int
    evictions: int
    store_refusals: int

@final
class Client:
    def __new__(
        cls,
        url: str,
        name: str,
        role: str = "worker",
        connect_timeout: float = 5.0,
        request_timeout: float = 30.0,
        fd_socket: str | None = None,
        heartbeat: bool = True,
    ) -> Client: ...
    @property
    def server(self) -> _ServerHello: ...
    # kvd's presence filter as mapped here (None: kvd keeps none, or it could not be mapped,
    # presence_error says why); first_absent: the first of `hashes` kvd certainly lacks on
    # `shard` (len(hashes): it may hold them all), None without a filter. Never blocks.
    @property
    def presence(self) -> str | None: ...
    @property
    def presence_error(self) -> str | None: ...
    def first_absent(self, fingerprint: int, salt: int, shard: int, hashes: Sequence[int]) -> int | None: ...
    # An unpinned lookup sent by the client's own threads, its reply unread (kvd learns the
    # prompt; the caller goes on at once). False: not sent, 64 such lookups being unanswered.
    def lookup_unread(
        self, fingerprint: int, salt: int, shards: Sequence[int], hashes: Sequence[int], readers: int = 1,
        last: bool = False, held: int = 0,
    ) -> bool: ...
    def connected(self) -> bool: ...
    def ping(self) -> int: ...
    def stats(self) -> _Stats: ...
    # A lookup gives (hit_chunks, pin_id); a release the number of chunk pins dropped; a store
    # or retrieve (outcome codes, one byte per chunk, and the done_slot of kvd's event or None).
    # The longest stored prefix of `hashes` (with `last`: the last of them stored, pinned alone;
    # the hit is its position + 1): (hit chunks, pin id or 0). `held`: leading chunks the caller
    # holds already and will not load (vLLM's prefix cache): kvd pins none of them and reads none
    # back from its disk, and one it has only on disk still counts towards the hit (0 with last).
    def lookup(
        self,
        fingerprint: int,
        salt: int,
        shards: Sequence[int],
        hashes: Sequence[int],
        pin: bool = True,
        readers: int = 1,
        last: bool = False,
        held: int = 0,
    ) -> Pending[tuple[int, int]]: ...
    def release(self, pin_id: int) -> Pending[int]: ...
    # The removal feed after sequence number `since` (0: from the oldest record kvd holds; past
    # kvd's newest, e.g. 2**64 - 1: from now), at most `max` (kvd sends at most 4096):
    # ([(fingerprint, salt, shard, hash)], next since, records missed because kvd's ring had
    # overwritten them). A kvd without the feed raises ServerError("Malformed", ...).
    def events(self, since: int, max: int) -> Pending[tuple[list[tuple[int, int, int, int]], int, int]]: ...
    # Keeps a served prompt under `group` (tokens: array.array("I", ids).tobytes(), salt its
    # cache_salt or ""), never waiting: None (nothing sent) while 16 are in flight; the Pending
    # gives the prompts the group holds.
    def remember(self, group: str, salt: str, tokens: bytes) -> Pending[int] | None: ...
    # The `index`-th newest prompt of `group`: ((salt, tokens, age_ms) or None, prompts held).
    def recall(self, group: str, index: int) -> Pending[tuple[tuple[str, list[int], int] | None, int]]: ...
    # deadline_ns: time.monotonic_ns() after which the blocks may be reused (0: none); kvd never
    # starts the copy after it, and the Pending then raises Expired (nothing copied).
    def store(
        self,
        region: int,
        salt: int,
        chunks: Sequence[tuple[int, Sequence[int]]],
        wait_slot: int | None = None,
        deadline_ns: int = 0,
    ) -> Pending[tuple[bytes, int | None]]: ...
    def retrieve(
        self,
        region: int,
        salt: int,
        chunks: Sequence[tuple[int, Sequence[int]]],
        pin_id: int = 0,
        wait_slot: int | None = None,
        deadline_ns: int = 0,
    ) -> Pending[tuple[bytes, int | None]]: ...
    def register(
        self, fingerprint: int, shard: int, device: str, layer_ptrs: Sequence[int], layout: dict[str, int], events: int = 64
    ) -> Registration: ...
    def unregister(self, region: int) -> None: ...
