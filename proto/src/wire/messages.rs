//! The messages of protocol v1. `docs/protocol.md` describes them for people; this file is the
//! definition both ends compile (the server and the `kvd._native` client).

use bytes::{BufMut, BytesMut};

use super::codec::{wire_enum, wire_struct, DecodeError, Reader, Wire};

/// A CUDA IPC handle (memory or event), 64 opaque bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IpcHandle(pub [u8; 64]);

impl std::fmt::Debug for IpcHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "IpcHandle({:02x}{:02x}{:02x}{:02x}..)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

impl Wire for IpcHandle {
    const MIN_BYTES: usize = 64;
    fn encode(&self, out: &mut BytesMut) {
        out.put_slice(&self.0);
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        Ok(IpcHandle(r.array()?))
    }
}

#[cfg(test)]
impl proptest::arbitrary::Arbitrary for IpcHandle {
    type Parameters = ();
    type Strategy = proptest::strategy::BoxedStrategy<Self>;
    fn arbitrary_with(_: ()) -> Self::Strategy {
        use proptest::prelude::*;
        proptest::collection::vec(any::<u8>(), 64)
            .prop_map(|v| {
                let mut h = [0u8; 64];
                h.copy_from_slice(&v);
                IpcHandle(h)
            })
            .boxed()
    }
}

wire_enum! {
    /// What a client is.
    pub enum Role {
        /// vLLM's scheduler: looks up prefixes.
        Scheduler = 1,
        /// A vLLM worker: registers KV caches, stores and retrieves.
        Worker = 2,
        /// Anything else (benchmarks, tools).
        Tool = 3,
    }
}

wire_struct! {
    /// First message of every session.
    pub struct Hello {
        /// Must equal [`super::PROTOCOL_VERSION`].
        pub protocol_version: u16,
        /// Free-form client name for logs, e.g. `vllm-worker-tp0`.
        pub client: String,
        /// The client's process id, for logs.
        pub pid: u32,
        /// What the client is.
        pub role: Role,
    }
}

wire_struct! {
    /// Reply to [`Hello`].
    pub struct HelloOk {
        /// The server's protocol version.
        pub protocol_version: u16,
        /// kvd's version string.
        pub server_version: String,
        /// Id of this session in kvd's logs.
        pub session_id: u64,
        /// Tokens per chunk: the unit of keys and pages.
        pub chunk_tokens: u32,
        /// Unix socket path for sharing file descriptors (host memory, VMM memory).
        pub fd_socket: String,
        /// A session that sends nothing for this long is closed and its pins and registrations
        /// released; clients ping at a third of it.
        pub session_timeout_ms: u32,
        /// Largest frame kvd accepts.
        pub max_frame_bytes: u32,
        /// kvd's presence filter (`crate::presence`), a file a client on kvd's host may map to
        /// skip lookups that would find nothing; empty when kvd keeps none.
        pub presence: String,
    }
}

/// Which device a registration's memory lives on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum DeviceSpec {
    /// Host memory (memfd) — the host backend.
    Host,
    /// A CUDA device, by UUID (so differing `CUDA_VISIBLE_DEVICES` don't matter).
    Cuda {
        /// `cuDeviceGetUuid`.
        uuid: [u8; 16],
    },
}

impl Wire for DeviceSpec {
    const MIN_BYTES: usize = 1;
    fn encode(&self, out: &mut BytesMut) {
        match self {
            DeviceSpec::Host => out.put_u8(0),
            DeviceSpec::Cuda { uuid } => {
                out.put_u8(1);
                uuid.encode(out);
            }
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::decode(r)? {
            0 => Ok(DeviceSpec::Host),
            1 => Ok(DeviceSpec::Cuda { uuid: r.array()? }),
            tag => Err(DecodeError::BadTag {
                what: "DeviceSpec",
                tag,
            }),
        }
    }
}

wire_struct! {
    /// One physical chunk of a VMM allocation, shared as a file descriptor.
    pub struct VmmChunk {
        /// Index of the chunk's descriptor among those sent under the registration's fd token.
        pub fd_index: u32,
        /// Offset of the chunk from the first chunk's first byte.
        pub offset_bytes: u64,
        /// Size of the chunk.
        pub size_bytes: u64,
    }
}

/// One client allocation holding KV cache.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum AllocationSpec {
    /// A sealed memfd sent over the fd socket (host backend).
    HostFd {
        /// Index of the descriptor among those sent under the registration's fd token.
        fd_index: u32,
        /// Bytes used from offset 0.
        size_bytes: u64,
    },
    /// A legacy CUDA IPC handle of the allocation base and the KV range inside it.
    CudaIpc {
        /// `cuIpcGetMemHandle` of the base returned by `cuMemGetAddressRange`.
        handle: IpcHandle,
        /// Offset of the KV range from that base.
        offset_bytes: u64,
        /// Bytes of the KV range.
        size_bytes: u64,
    },
    /// CUDA VMM memory (expandable segments, cumem): one descriptor per physical chunk.
    CudaVmm {
        /// The chunks, in address order, tiling a span from the first chunk's first byte.
        chunks: Vec<VmmChunk>,
        /// Offset of the KV range from the first chunk's first byte.
        offset_bytes: u64,
        /// Bytes of the KV range.
        size_bytes: u64,
    },
}

impl Wire for AllocationSpec {
    const MIN_BYTES: usize = 1;
    fn encode(&self, out: &mut BytesMut) {
        match self {
            AllocationSpec::HostFd {
                fd_index,
                size_bytes,
            } => {
                out.put_u8(0);
                fd_index.encode(out);
                size_bytes.encode(out);
            }
            AllocationSpec::CudaIpc {
                handle,
                offset_bytes,
                size_bytes,
            } => {
                out.put_u8(1);
                handle.encode(out);
                offset_bytes.encode(out);
                size_bytes.encode(out);
            }
            AllocationSpec::CudaVmm {
                chunks,
                offset_bytes,
                size_bytes,
            } => {
                out.put_u8(2);
                chunks.encode(out);
                offset_bytes.encode(out);
                size_bytes.encode(out);
            }
        }
    }
    fn decode(r: &mut Reader<'_>) -> Result<Self, DecodeError> {
        match u8::decode(r)? {
            0 => Ok(AllocationSpec::HostFd {
                fd_index: Wire::decode(r)?,
                size_bytes: Wire::decode(r)?,
            }),
            1 => Ok(AllocationSpec::CudaIpc {
                handle: Wire::decode(r)?,
                offset_bytes: Wire::decode(r)?,
                size_bytes: Wire::decode(r)?,
            }),
            2 => Ok(AllocationSpec::CudaVmm {
                chunks: Wire::decode(r)?,
                offset_bytes: Wire::decode(r)?,
                size_bytes: Wire::decode(r)?,
            }),
            tag => Err(DecodeError::BadTag {
                what: "AllocationSpec",
                tag,
            }),
        }
    }
}

wire_struct! {
    /// The shape of one layer's KV blocks, in bytes. Every vLLM layout is a permutation of
    /// `[layer, block, (kv plane,) head, token, content]`; a layer's blocks are found at
    /// `offset + block * block_stride + plane * plane_stride`, and the heads, tokens and content
    /// of one (block, plane) must form one dense run.
    pub struct KvLayout {
        /// Bytes per element (2 for bf16/fp16, 1 for fp8).
        pub elem_bytes: u8,
        /// Blocks per layer.
        pub num_blocks: u32,
        /// 1 when K and V are packed in the content dim (vLLM ≥0.33, FlashInfer, MLA); 2 when
        /// they are separate planes (older FlashAttention: `(2, blocks, ...)`).
        pub kv_planes: u8,
        /// KV heads per block (1 for MLA).
        pub heads: u32,
        /// Tokens per block.
        pub block_tokens: u32,
        /// Elements per (head, token) — head size, 2×head size when K and V are packed, 576 for
        /// DeepSeek MLA.
        pub content: u32,
        /// Byte stride between blocks.
        pub block_stride_bytes: u64,
        /// Byte stride between K and V planes (0 when `kv_planes` is 1).
        pub plane_stride_bytes: u64,
        /// Byte stride between heads.
        pub head_stride_bytes: u64,
        /// Byte stride between tokens.
        pub token_stride_bytes: u64,
        /// Byte stride between content elements (normally `elem_bytes`).
        pub content_stride_bytes: u64,
        /// Tokens of a request one row of the token dimension holds: 1, or the compression
        /// ratio of a compressed cache (DeepSeek-V4 keeps one state per 4 or per 128 tokens),
        /// so one block covers `block_tokens × state_tokens` tokens.
        pub state_tokens: u32,
    }
}

wire_struct! {
    /// Where one layer's block 0 (plane 0) lives.
    pub struct LayerPlacement {
        /// Index into the registration's allocations.
        pub allocation: u16,
        /// Offset inside that allocation's KV range.
        pub offset_bytes: u64,
    }
}

wire_struct! {
    /// Registers one worker's KV cache (one per allocation group of a rank).
    pub struct Register {
        /// Model and layout fingerprint, computed by the client library; part of every key.
        pub fingerprint: u64,
        /// KV shard this cache holds (the TP rank; 0 for MLA, which every rank shares).
        pub shard: u32,
        /// The device the memory lives on.
        pub device: DeviceSpec,
        /// Token under which the client sent descriptors over the fd socket (0 when none).
        pub fd_token: u128,
        /// The allocations.
        pub allocations: Vec<AllocationSpec>,
        /// Block geometry shared by all layers.
        pub layout: KvLayout,
        /// Per-layer placement, in layer order.
        pub layers: Vec<LayerPlacement>,
        /// The client's interprocess event handles (CUDA); kvd waits on slot `i` when a store
        /// or retrieve names `wait_slot = i`.
        pub client_events: Vec<IpcHandle>,
    }
}

wire_struct! {
    /// Reply to [`Register`].
    pub struct Registered {
        /// Handle for store, retrieve and unregister.
        pub region: u32,
        /// Bytes of one page: one chunk of this shard.
        pub page_bytes: u64,
        /// Blocks per chunk; every chunk in a store or retrieve names this many block ids.
        pub chunk_blocks: u32,
        /// kvd's own interprocess events (CUDA); replies name a slot the client polls.
        pub server_events: Vec<IpcHandle>,
    }
}

wire_struct! {
    /// Releases a registration and everything kvd imported for it.
    pub struct Unregister {
        /// From [`Registered`].
        pub region: u32,
    }
}

wire_struct! {
    /// Asks how many leading chunks of a token sequence are stored.
    pub struct Lookup {
        /// Model and layout fingerprint.
        pub fingerprint: u64,
        /// Hash of the request's cache salt (0 for none).
        pub salt: u64,
        /// Shards that must all hold a chunk for it to count (every TP rank; `[0]` for MLA).
        pub shards: Vec<u32>,
        /// Chained chunk hashes, first chunk first.
        pub hashes: Vec<u128>,
        /// Pin the hit chunks until retrieved, released, or timed out.
        pub pin: bool,
        /// How many retrieves of each shard release the pin (the number of ranks reading one
        /// shard: 1, or the TP size for MLA).
        pub readers: u16,
        /// Leading chunks the client holds already (vLLM's own prefix cache): it loads none
        /// of them, so kvd neither pins them nor reads them back from a tier below L1. One
        /// that L1 lacks still counts towards the hit where the disk tier holds it. 0 for
        /// none; at most `hashes.len()`. A `LookupLast` must send 0.
        pub held: u32,
    }
}

wire_struct! {
    /// Reply to [`Lookup`].
    pub struct LookupReply {
        /// Leading chunks stored on every named shard.
        pub hit_chunks: u32,
        /// Pin id to pass to retrieve or release; 0 when nothing was pinned.
        pub pin_id: u64,
    }
}

wire_struct! {
    /// One chunk of a store or retrieve: its key and the blocks that hold it.
    pub struct ChunkBlocks {
        /// Chained chunk hash.
        pub hash: u128,
        /// Block ids in the registered cache, `chunk_blocks` of them, in token order.
        pub blocks: Vec<u32>,
    }
}

wire_struct! {
    /// Copies chunks from the registered cache into the pool.
    pub struct Store {
        /// From [`Registered`].
        pub region: u32,
        /// Hash of the cache salt.
        pub salt: u64,
        /// The chunks.
        pub chunks: Vec<ChunkBlocks>,
        /// Client event slot recorded after the forward that wrote these blocks.
        pub wait_slot: Option<u16>,
        /// When the client may reuse these blocks: `CLOCK_MONOTONIC` nanoseconds of the host
        /// both share (0: no deadline). kvd never starts the copy after it: a store that
        /// reaches the device too late is answered [`ErrorCode::Expired`] and copies nothing.
        pub deadline_ns: u64,
    }
}

wire_enum! {
    /// What happened to one chunk of a store.
    pub enum StoreOutcome {
        /// Copied into the pool (visible to lookups once the copy completes).
        Stored = 0,
        /// Already stored (or being stored); nothing copied.
        AlreadyStored = 1,
        /// No page could be found or evicted: the pool is full of pinned pages. Not stored.
        RefusedPoolFull = 2,
        /// The chunk was not attempted because an earlier chunk of the same request was refused.
        Skipped = 3,
    }
}

wire_struct! {
    /// Reply to [`Store`].
    pub struct StoreReply {
        /// One outcome per chunk, in request order.
        pub outcomes: Vec<StoreOutcome>,
        /// kvd event slot that completes when the copies have read the blocks (CUDA); `None`
        /// when they had already completed when this reply was sent.
        pub done_slot: Option<u16>,
    }
}

wire_struct! {
    /// Copies stored chunks from the pool into the registered cache.
    pub struct Retrieve {
        /// From [`Registered`].
        pub region: u32,
        /// Hash of the cache salt.
        pub salt: u64,
        /// Pin from the lookup that found these chunks (0 for none); one reader of it is
        /// released when the copy completes.
        pub pin_id: u64,
        /// The chunks.
        pub chunks: Vec<ChunkBlocks>,
        /// Client event slot to wait on before writing the blocks.
        pub wait_slot: Option<u16>,
        /// When the client stops waiting for these blocks and may give them to other work:
        /// `CLOCK_MONOTONIC` nanoseconds (0: no deadline). kvd never starts the copy after it
        /// (answered [`ErrorCode::Expired`], nothing written).
        pub deadline_ns: u64,
    }
}

wire_enum! {
    /// What happened to one chunk of a retrieve.
    pub enum RetrieveOutcome {
        /// Copied into the blocks.
        Loaded = 0,
        /// Not stored (evicted, never stored, or still being written); the blocks are untouched.
        Missing = 1,
    }
}

/// A block id in a retrieve that kvd leaves untouched: its tokens are already computed on the
/// client, so only the rest of the chunk is copied.
pub const SKIP_BLOCK: u32 = u32::MAX;

wire_struct! {
    /// Reply to [`Retrieve`].
    pub struct RetrieveReply {
        /// One outcome per chunk, in request order.
        pub outcomes: Vec<RetrieveOutcome>,
        /// kvd event slot that completes when the blocks are written (CUDA); `None` when the
        /// copies had completed when this reply was sent.
        pub done_slot: Option<u16>,
    }
}

wire_struct! {
    /// Drops a pin taken by a lookup.
    pub struct Release {
        /// From [`LookupReply`].
        pub pin_id: u64,
    }
}

wire_struct! {
    /// Reply to [`Release`].
    pub struct Released {
        /// Chunk pins dropped (0 when the pin had already ended).
        pub chunks: u32,
    }
}

wire_struct! {
    /// Liveness check; also keeps the session alive.
    pub struct Ping {}
}

wire_struct! {
    /// Reply to [`Ping`].
    pub struct Pong {
        /// Milliseconds since kvd started.
        pub uptime_ms: u64,
    }
}

wire_struct! {
    /// Asks for counters.
    pub struct StatsRequest {}
}

wire_struct! {
    /// Reply to [`StatsRequest`].
    pub struct Stats {
        /// Pool size.
        pub pool_bytes_total: u64,
        /// Bytes in pages that hold or are receiving chunks.
        pub pool_bytes_used: u64,
        /// Stored chunks.
        pub chunks: u64,
        /// Pages with a pin (lookup or in-flight copy).
        pub pinned_pages: u64,
        /// Open sessions.
        pub sessions: u32,
        /// Registered regions.
        pub regions: u32,
        /// Chunks evicted since start.
        pub evictions: u64,
        /// Chunks refused by stores since start.
        pub store_refusals: u64,
    }
}

wire_struct! {
    /// Asks for the removal feed: the chunks that left kvd's pool after sequence number
    /// `since`, oldest first.
    pub struct Events {
        /// The last sequence number the client has read (`next` of its previous reply); 0 reads
        /// from the oldest record kvd still holds. A value beyond kvd's newest (`u64::MAX`, or a
        /// position from before a kvd restart) returns no records and kvd's newest sequence, so
        /// a client can start reading from now.
        pub since: u64,
        /// Most records wanted; kvd sends at most [`super::MAX_EVENTS_PER_REPLY`].
        pub max: u32,
    }
}

wire_struct! {
    /// One chunk that left the pool (evicted, or dropped because its copy failed), keyed as
    /// the client keyed it.
    pub struct RemovedChunk {
        /// Model and layout fingerprint of the registration that stored it.
        pub fingerprint: u64,
        /// Hash of the cache salt.
        pub salt: u64,
        /// KV shard.
        pub shard: u32,
        /// Chained chunk hash.
        pub hash: u128,
    }
}

wire_struct! {
    /// Reply to [`Events`].
    pub struct EventsReply {
        /// Removals after `since` (and after any dropped ones), oldest first; record `i` has
        /// sequence number `next - records.len() + 1 + i`.
        pub records: Vec<RemovedChunk>,
        /// The sequence number to pass as `since` next time: the last record sent, or the one
        /// before the first record kvd could have sent.
        pub next: u64,
        /// Records after `since` that kvd no longer held (its ring had overwritten them), and
        /// that `next` skips; nonzero means the client missed removals.
        pub dropped: u64,
    }
}

wire_struct! {
    /// Keeps a prompt an engine served under `group` (a name the operator gives a vLLM replica
    /// that stays the same across its restarts), so that its replacement can be warmed with the
    /// prompts it will see again ([`Recall`]). kvd keeps the newest prompts of each group within
    /// `--recall-mb`; one that extends an older prompt of the group (the next turn of a
    /// conversation) replaces it.
    pub struct Remember {
        /// The replica's name (1 to 256 bytes).
        pub group: String,
        /// The request's `cache_salt` ("" for none): its chunks are keyed under it.
        pub salt: String,
        /// The prompt's token ids.
        pub tokens: Vec<u32>,
    }
}

wire_struct! {
    /// Reply to [`Remember`].
    pub struct Remembered {
        /// Prompts the group holds now.
        pub prompts: u32,
    }
}

wire_struct! {
    /// Asks for one prompt a group remembered: the `index`-th newest (0 the newest).
    pub struct Recall {
        /// The replica's name, as remembered.
        pub group: String,
        /// 0 for the newest prompt, 1 for the one before, and so on.
        pub index: u32,
    }
}

wire_struct! {
    /// A remembered prompt.
    pub struct RecalledPrompt {
        /// The request's `cache_salt` ("" for none).
        pub salt: String,
        /// Its token ids.
        pub tokens: Vec<u32>,
        /// Milliseconds since it was remembered.
        pub age_ms: u64,
    }
}

wire_struct! {
    /// Reply to [`Recall`].
    pub struct Recalled {
        /// The prompt at `index`, or none past the group's last.
        pub prompt: Option<RecalledPrompt>,
        /// Prompts the group holds.
        pub prompts: u32,
    }
}

wire_enum! {
    /// Typed error codes; the message says what to do.
    pub enum ErrorCode {
        /// The frame could not be decoded.
        Malformed = 1,
        /// The frame or hello names another protocol version.
        VersionMismatch = 2,
        /// The session has not said hello.
        HelloRequired = 3,
        /// No such region (never registered, unregistered, or the session ended).
        UnknownRegion = 4,
        /// An argument is out of range or inconsistent.
        InvalidArgument = 5,
        /// kvd is still populating or pinning its pool.
        NotReady = 6,
        /// kvd is shutting down.
        ShuttingDown = 7,
        /// The device failed (import, copy, driver).
        Device = 8,
        /// The memory is CUDA VMM memory and cannot be shared by legacy IPC.
        VmmMemory = 9,
        /// A queue is full; retry later.
        Busy = 10,
        /// Descriptors named by an fd token were not received.
        FdMissing = 11,
        /// A bug in kvd.
        Internal = 12,
        /// The request's deadline passed before kvd could start its copy: nothing was copied.
        Expired = 13,
    }
}

wire_struct! {
    /// The reply to any request that failed.
    pub struct ErrorReply {
        /// What kind of failure.
        pub code: ErrorCode,
        /// What happened and how to fix it.
        pub message: String,
    }
}
