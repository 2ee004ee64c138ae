//! One function per request kind. Every request gets exactly one reply: its result or a typed
//! error whose message says what to do. This is also the one place that maps internal errors to
//! wire error codes.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use kvd_gpu::copy::{coalesce_within, total_bytes};
use kvd_gpu::{CopyJob, CopyRun, Direction, GpuError, ImportSource};
use tokio::time::Instant;

use crate::cache::{Key, StorePlan};
use crate::copier::SubmitError;
use crate::geometry::Geometry;
use crate::router::PeerId;
use crate::session::{ClientInfo, Region};
use crate::state::{Phase, State};
use crate::tier::WriteItem;
use crate::wire::*;

/// Most chunks in one store, retrieve or lookup.
pub const MAX_CHUNKS_PER_REQUEST: usize = 16_384;
/// Most shards in one lookup.
pub const MAX_SHARDS: usize = 1024;
/// kvd events per CUDA registration.
pub const SERVER_EVENT_SLOTS: usize = 256;

fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
    Reply::error(code, message)
}

/// Maps a device-layer error to a reply: the one place that does.
pub fn device_error(e: &GpuError) -> Reply {
    match e {
        GpuError::VmmMemory => error(ErrorCode::VmmMemory, e.to_string()),
        GpuError::Invalid(_) | GpuError::OutOfBounds { .. } => {
            error(ErrorCode::InvalidArgument, e.to_string())
        }
        _ => error(ErrorCode::Device, e.to_string()),
    }
}

fn submit_error(state: &State, e: &SubmitError) -> Reply {
    match e {
        SubmitError::Busy { .. } => {
            state.metrics.copy_queue_full.inc();
            error(ErrorCode::Busy, e.to_string())
        }
        SubmitError::Stopped(_) => error(ErrorCode::ShuttingDown, e.to_string()),
        SubmitError::Device(g) => device_error(g),
    }
}

/// Answers a hello. Handled in arrival order by the control loop, so it precedes the
/// session's other requests.
pub fn hello(state: &State, peer: PeerId, h: &Hello) -> Reply {
    if h.protocol_version != PROTOCOL_VERSION as u16 {
        return error(
            ErrorCode::VersionMismatch,
            format!(
                "client speaks kvd protocol {} but this kvd ({}) speaks {}; install the kvd \
                 client package that matches this server",
                h.protocol_version,
                env!("CARGO_PKG_VERSION"),
                PROTOCOL_VERSION
            ),
        );
    }
    let mut sessions = state.sessions.lock();
    let Some(session) = sessions.get_mut(peer) else {
        return error(ErrorCode::Internal, "no session for this connection");
    };
    session.client = Some(ClientInfo {
        name: h.client.clone(),
        pid: h.pid,
        role: h.role,
    });
    tracing::info!(session = session.id, client = %h.client, pid = h.pid, role = ?h.role, "hello");
    Reply::Hello(HelloOk {
        protocol_version: PROTOCOL_VERSION as u16,
        server_version: env!("CARGO_PKG_VERSION").to_string(),
        session_id: session.id,
        chunk_tokens: state.config.chunk_tokens,
        fd_socket: state.config.fd_socket.display().to_string(),
        session_timeout_ms: state.config.session_timeout.as_millis() as u32,
        max_frame_bytes: state.config.max_frame_bytes as u32,
    })
}

/// The session of a peer that has said hello, or the error reply.
fn session_of(state: &State, peer: PeerId) -> Result<u64, Reply> {
    let sessions = state.sessions.lock();
    match sessions.get(peer) {
        Some(s) if s.client.is_some() => Ok(s.id),
        Some(_) => Err(error(
            ErrorCode::HelloRequired,
            "send hello (with the protocol version) before any other request",
        )),
        None => Err(error(ErrorCode::Internal, "no session for this connection")),
    }
}

/// Answers the requests that never wait (hello, ping, stats, lookup, release) on the spot;
/// hands the others back for [`handle`].
pub fn handle_now(state: &State, peer: PeerId, req: Request) -> Result<Reply, Box<Request>> {
    if let Request::Hello(h) = &req {
        return Ok(hello(state, peer, h));
    }
    let session = match session_of(state, peer) {
        Ok(s) => s,
        Err(reply) => return Ok(reply),
    };
    Ok(match req {
        Request::Ping(_) => Reply::Pong(Pong {
            uptime_ms: state.started.elapsed().as_millis() as u64,
        }),
        Request::Stats(_) => stats(state),
        // With an L2, a lookup may wait for it: answered by `handle`.
        Request::Lookup(l) if state.tier.get().is_some() => {
            return Err(Box::new(Request::Lookup(l)))
        }
        Request::Lookup(l) => lookup(state, session, &l),
        Request::Release(r) => Reply::Released(Released {
            chunks: state.cache.lock().release(r.pin_id),
        }),
        Request::Unregister(u) => {
            if state.sessions.lock().remove_region(peer, u.region) {
                state.refresh_metrics();
                Reply::Unregistered
            } else {
                error(
                    ErrorCode::UnknownRegion,
                    format!("region {} is not registered by this session", u.region),
                )
            }
        }
        other => return Err(Box::new(other)),
    })
}

/// Answers the requests that wait on a device (register, store, retrieve).
pub async fn handle(state: Arc<State>, peer: PeerId, req: Request) -> Reply {
    let session = match session_of(&state, peer) {
        Ok(s) => s,
        Err(reply) => return reply,
    };
    match req {
        Request::Lookup(l) => {
            if let Some(tier) = state.tier.get() {
                crate::tier::fetch::fill_for_lookup(&state, tier, &l).await;
            }
            lookup(&state, session, &l)
        }
        Request::Register(r) => register(&state, peer, r).await,
        Request::Store(s) => store(&state, peer, s).await,
        Request::Retrieve(r) => retrieve(&state, peer, r).await,
        other => match handle_now(&state, peer, other) {
            Ok(reply) => reply,
            Err(_) => error(ErrorCode::Internal, "request kind without a handler"),
        },
    }
}

fn stats(state: &State) -> Reply {
    let s = state.cache.lock().stats();
    let sessions = state.sessions.lock();
    Reply::Stats(Stats {
        pool_bytes_total: s.capacity_bytes,
        pool_bytes_used: s.usage.used_bytes,
        chunks: s.entries,
        pinned_pages: s.pinned_pages,
        sessions: sessions.session_count() as u32,
        regions: sessions.region_count() as u32,
        evictions: s.counters.evictions,
        store_refusals: s.counters.store_refusals,
    })
}

fn lookup(state: &State, session: u64, l: &Lookup) -> Reply {
    if l.hashes.len() > MAX_CHUNKS_PER_REQUEST || l.shards.len() > MAX_SHARDS {
        return error(
            ErrorCode::InvalidArgument,
            format!(
                "a lookup may name at most {MAX_CHUNKS_PER_REQUEST} chunks and {MAX_SHARDS} shards"
            ),
        );
    }
    if l.shards.is_empty() {
        return error(
            ErrorCode::InvalidArgument,
            "a lookup must name at least one shard",
        );
    }
    let (hit, pin_id) = state.cache.lock().lookup(
        session,
        l.fingerprint,
        l.salt,
        &l.shards,
        &l.hashes,
        l.pin,
        l.readers,
        Instant::now(),
        state.config.pin_timeout,
    );
    let m = &state.metrics;
    m.lookups
        .with_label_values(&[if hit > 0 { "hit" } else { "miss" }])
        .inc();
    m.lookup_chunks
        .with_label_values(&["hit"])
        .inc_by(hit as u64);
    m.lookup_chunks
        .with_label_values(&["miss"])
        .inc_by((l.hashes.len() as u64).saturating_sub(hit as u64));
    Reply::Lookup(LookupReply {
        hit_chunks: hit,
        pin_id,
    })
}

fn not_ready(state: &State) -> Reply {
    let why = match state.phase() {
        Phase::Populating { fraction, .. } => format!(
            "kvd is still populating its pool ({:.0}%)",
            fraction * 100.0
        ),
        Phase::Pinning => "kvd is pinning its pool for DMA".to_string(),
        Phase::Failed(e) => return error(ErrorCode::Device, format!("kvd has no pool: {e}")),
        Phase::ShuttingDown => return error(ErrorCode::ShuttingDown, "kvd is shutting down"),
        _ => "kvd is starting".to_string(),
    };
    error(
        ErrorCode::NotReady,
        format!("{why}; retry once /healthz answers 200"),
    )
}

async fn register(state: &Arc<State>, peer: PeerId, r: Register) -> Reply {
    let refuse = |reason: &str, reply: Reply| {
        state
            .metrics
            .registration_refusals
            .with_label_values(&[reason])
            .inc();
        if let Reply::Error(e) = &reply {
            tracing::warn!(reason, "registration refused: {}", e.message);
        }
        reply
    };
    let Some(devices) = state.devices.get() else {
        return not_ready(state);
    };
    if r.allocations.is_empty() || r.allocations.len() > crate::geometry::MAX_ALLOCATIONS {
        return refuse(
            "invalid",
            error(
                ErrorCode::InvalidArgument,
                "a registration needs 1 to 4096 allocations",
            ),
        );
    }
    let sizes: Vec<u64> = r
        .allocations
        .iter()
        .map(|a| match a {
            AllocationSpec::HostFd { size_bytes, .. }
            | AllocationSpec::CudaIpc { size_bytes, .. }
            | AllocationSpec::CudaVmm { size_bytes, .. } => *size_bytes,
        })
        .collect();
    let geometry = match Geometry::new(&r.layout, &r.layers, &sizes, state.config.chunk_tokens) {
        Ok(g) => g,
        Err(e) => {
            return refuse(
                "invalid",
                error(ErrorCode::InvalidArgument, format!("bad KV layout: {e}")),
            )
        }
    };
    if let Err(msg) = state
        .sessions
        .lock()
        .check_digest(r.fingerprint, geometry.digest())
    {
        return refuse("invalid", error(ErrorCode::InvalidArgument, msg));
    }
    let class = match state.cache.lock().class_for(geometry.page_bytes()) {
        Ok(c) => c,
        Err(e) => return refuse("invalid", error(ErrorCode::InvalidArgument, e.to_string())),
    };
    let needs_fds = r
        .allocations
        .iter()
        .any(|a| !matches!(a, AllocationSpec::CudaIpc { .. }));
    let has_vmm = r
        .allocations
        .iter()
        .any(|a| matches!(a, AllocationSpec::CudaVmm { .. }));
    if has_vmm && r.fd_token == 0 {
        return refuse(
            "vmm_memory",
            error(
                ErrorCode::VmmMemory,
                format!(
                    "{} — the client sent VMM memory without its descriptors; they go over the fd \
                     socket {} (check that the client can reach it)",
                    GpuError::VmmMemory,
                    state.config.fd_socket.display()
                ),
            ),
        );
    }
    let mut fds: Vec<Option<OwnedFd>> = if needs_fds {
        match state.fds.take(r.fd_token) {
            Some(f) if r.fd_token != 0 => f.into_iter().map(Some).collect(),
            _ => {
                return refuse(
                    "fd_missing",
                    error(
                        ErrorCode::FdMissing,
                        format!(
                            "no descriptors arrived under fd token {:#x}; send them to {} before registering",
                            r.fd_token,
                            state.config.fd_socket.display()
                        ),
                    ),
                )
            }
        }
    } else {
        Vec::new()
    };
    let mut take_fd = |i: usize, index: u32| {
        fds.get_mut(index as usize).and_then(Option::take).ok_or_else(|| {
            refuse(
                "invalid",
                error(
                    ErrorCode::InvalidArgument,
                    format!("allocation {i} names descriptor {index}, which was not sent or is used twice"),
                ),
            )
        })
    };
    let mut sources = Vec::with_capacity(r.allocations.len());
    for (i, a) in r.allocations.iter().enumerate() {
        let src = match a {
            AllocationSpec::HostFd {
                fd_index,
                size_bytes,
            } => match take_fd(i, *fd_index) {
                Ok(fd) => ImportSource::HostFd {
                    fd,
                    size_bytes: *size_bytes,
                },
                Err(reply) => return reply,
            },
            AllocationSpec::CudaIpc {
                handle,
                offset_bytes,
                size_bytes,
            } => ImportSource::CudaIpc {
                handle: handle.0,
                offset_bytes: *offset_bytes,
                size_bytes: *size_bytes,
            },
            AllocationSpec::CudaVmm {
                chunks,
                offset_bytes,
                size_bytes,
            } => {
                let mut taken = Vec::with_capacity(chunks.len());
                for c in chunks {
                    match take_fd(i, c.fd_index) {
                        Ok(fd) => taken.push((fd, c.offset_bytes, c.size_bytes)),
                        Err(reply) => return reply,
                    }
                }
                ImportSource::CudaVmm {
                    chunks: taken,
                    offset_bytes: *offset_bytes,
                    size_bytes: *size_bytes,
                }
            }
        };
        sources.push(src);
    }
    // Descriptors sent but not named are closed here.
    drop(fds);

    let (device, worker) = match devices.device_for(&r.device) {
        Ok(d) => d,
        Err(e) => return refuse("device", device_error(&e)),
    };
    let client_events: Vec<[u8; 64]> = r.client_events.iter().map(|h| h.0).collect();
    let dev = device.clone();
    let imported = tokio::task::spawn_blocking(move || {
        let memories = sources
            .into_iter()
            .map(|s| dev.import(s))
            .collect::<Result<Vec<_>, _>>()?;
        let events = dev.open_events(&client_events, SERVER_EVENT_SLOTS)?;
        Ok::<_, GpuError>((memories, events))
    })
    .await;
    let (memories, events) = match imported {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            let reason = if matches!(e, GpuError::VmmMemory) {
                "vmm_memory"
            } else {
                "device"
            };
            return refuse(reason, device_error(&e));
        }
        Err(e) => {
            return refuse(
                "device",
                error(ErrorCode::Internal, format!("import task failed: {e}")),
            )
        }
    };
    let page_bytes = geometry.page_bytes();
    let chunk_blocks = geometry.chunk_blocks();
    let server_events = events
        .as_ref()
        .map(|e| e.server_handles().into_iter().map(IpcHandle).collect())
        .unwrap_or_default();
    let digest = geometry.digest();
    let region = state
        .sessions
        .lock()
        .add_region(peer, digest, |id, session| Region {
            id,
            session,
            fingerprint: r.fingerprint,
            shard: r.shard,
            geometry,
            class,
            device: r.device,
            memories,
            events,
            worker,
        });
    let Some(region) = region else {
        return error(ErrorCode::Internal, "the session ended during registration");
    };
    state.refresh_metrics();
    tracing::info!(
        region = region.id,
        device = %device.label(),
        fingerprint = format_args!("{:#018x}", r.fingerprint),
        shard = r.shard,
        layers = r.layers.len(),
        blocks = r.layout.num_blocks,
        page_bytes,
        "registered KV cache"
    );
    Reply::Registered(Registered {
        region: region.id,
        page_bytes,
        chunk_blocks,
        server_events,
    })
}

fn region_for(state: &State, peer: PeerId, id: u32) -> Result<Arc<Region>, Reply> {
    state.sessions.lock().region(peer, id).ok_or_else(|| {
        error(
            ErrorCode::UnknownRegion,
            format!("region {id} is not registered by this session (unregistered, or the session was reset); register again"),
        )
    })
}

fn check_chunks(region: &Region, chunks: &[ChunkBlocks], allow_skip: bool) -> Result<(), Reply> {
    if chunks.len() > MAX_CHUNKS_PER_REQUEST {
        return Err(error(
            ErrorCode::InvalidArgument,
            format!("at most {MAX_CHUNKS_PER_REQUEST} chunks per request"),
        ));
    }
    for (i, c) in chunks.iter().enumerate() {
        region
            .geometry
            .check_blocks(&c.blocks, allow_skip)
            .map_err(|e| error(ErrorCode::InvalidArgument, format!("chunk {i}: {e}")))?;
    }
    Ok(())
}

fn check_wait_slot(region: &Region, wait_slot: Option<u16>) -> Result<(), Reply> {
    match (wait_slot, &region.events) {
        (None, _) => Ok(()),
        (Some(_), None) => Err(error(
            ErrorCode::InvalidArgument,
            "wait_slot given but this registration has no events",
        )),
        (Some(_), Some(_)) => Ok(()),
    }
}

/// A store's or retrieve's prologue: resolves the region, checks the chunks (`allow_skip`: a
/// retrieve may leave blocks untouched) and the wait slot, and keys the chunks for the cache.
fn prepare_copy(
    state: &State,
    peer: PeerId,
    region: u32,
    salt: u64,
    chunks: &[ChunkBlocks],
    allow_skip: bool,
    wait_slot: Option<u16>,
) -> Result<(Arc<Region>, Vec<Key>), Reply> {
    let region = region_for(state, peer, region)?;
    check_chunks(&region, chunks, allow_skip)?;
    check_wait_slot(&region, wait_slot)?;
    let keys = chunks
        .iter()
        .map(|c| Key {
            fingerprint: region.fingerprint,
            salt,
            shard: region.shard,
            hash: c.hash,
        })
        .collect();
    Ok((region, keys))
}

fn job(
    region: &Region,
    direction: Direction,
    runs: Vec<CopyRun>,
    wait_slot: Option<u16>,
) -> CopyJob {
    CopyJob {
        direction,
        memories: region.memories.clone(),
        runs,
        events: region.events.clone(),
        wait_slot,
    }
}

async fn store(state: &Arc<State>, peer: PeerId, s: Store) -> Reply {
    let (region, keys) =
        match prepare_copy(state, peer, s.region, s.salt, &s.chunks, false, s.wait_slot) {
            Ok(x) => x,
            Err(e) => return e,
        };
    let plans = state.cache.lock().begin_store(region.class, &keys);
    let mut runs = Vec::new();
    let mut writing = Vec::new();
    let mut written_keys = Vec::new();
    let mut outcomes = Vec::with_capacity(plans.len());
    for ((plan, chunk), key) in plans.iter().zip(&s.chunks).zip(&keys) {
        outcomes.push(match plan {
            StorePlan::Write { entry, offset } => {
                region.geometry.push_runs(&chunk.blocks, *offset, &mut runs);
                writing.push(*entry);
                written_keys.push(*key);
                StoreOutcome::Stored
            }
            StorePlan::Present => StoreOutcome::AlreadyStored,
            StorePlan::Refused => StoreOutcome::RefusedPoolFull,
            StorePlan::Skipped => StoreOutcome::Skipped,
        });
    }
    let m = &state.metrics;
    for o in &outcomes {
        let label = match o {
            StoreOutcome::Stored => "stored",
            StoreOutcome::AlreadyStored => "already_stored",
            StoreOutcome::RefusedPoolFull => "refused_pool_full",
            StoreOutcome::Skipped => "skipped",
        };
        m.store_chunks.with_label_values(&[label]).inc();
    }
    if writing.is_empty() {
        return Reply::Store(StoreReply {
            outcomes,
            done_slot: None,
        });
    }
    let region_id = region.id;
    let digest = region.geometry.digest();
    let settle = move |state: &State, end: CopyEnd| {
        let ok = end == CopyEnd::Done(true);
        state.cache.lock().finish_store(&writing, ok);
        if let (true, Some(tier)) = (ok, state.tier.get()) {
            tier.write_behind(
                written_keys
                    .into_iter()
                    .map(|key| WriteItem { key, digest }),
            );
        }
        if end == CopyEnd::Done(false) {
            tracing::warn!(
                region = region_id,
                "a store's copy failed; its chunks were dropped"
            );
        }
    };
    let copied = copy(state, &region, Direction::D2h, runs, s.wait_slot, settle).await;
    match copied {
        Ok(done_slot) => Reply::Store(StoreReply {
            outcomes,
            done_slot,
        }),
        Err(reply) => reply,
    }
}

/// How a copy ended, for the request to settle its entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyEnd {
    /// The device refused the job; nothing was copied.
    NotSubmitted,
    /// The copy completed, successfully or not.
    Done(bool),
}

/// Submits a request's runs to its device and settles the cache once they are done: at once
/// when the client gave no event (the reply then waits for the copy), else in the background
/// while the reply names kvd's event slot for the client to poll.
async fn copy(
    state: &Arc<State>,
    region: &Arc<Region>,
    direction: Direction,
    mut runs: Vec<CopyRun>,
    wait_slot: Option<u16>,
    settle: impl FnOnce(&State, CopyEnd) + Send + 'static,
) -> Result<Option<u16>, Reply> {
    // Chunks in neighbouring pages merge into one descriptor, but never across a pinned piece.
    coalesce_within(&mut runs, state.config.slab_bytes);
    let bytes = total_bytes(&runs);
    let submitted = match region
        .worker
        .submit(job(region, direction, runs, wait_slot))
        .await
    {
        Ok(sub) => sub,
        Err(e) => {
            settle(state, CopyEnd::NotSubmitted);
            return Err(submit_error(state, &e));
        }
    };
    let finish = {
        let state = state.clone();
        async move {
            let ok = matches!(submitted.done.await, Ok(Ok(())));
            settle(&state, CopyEnd::Done(ok));
            if ok {
                match direction {
                    Direction::D2h => state.metrics.bytes_stored.inc_by(bytes),
                    Direction::H2d => state.metrics.bytes_retrieved.inc_by(bytes),
                }
            }
            ok
        }
    };
    match submitted.event_slot {
        Some(slot) => {
            tokio::spawn(finish);
            Ok(Some(slot))
        }
        None if finish.await => Ok(None),
        None => Err(error(
            ErrorCode::Device,
            match direction {
                Direction::D2h => "the copy into the pool failed; nothing was stored",
                Direction::H2d => {
                    "the copy from the pool failed; treat every chunk as missing and recompute"
                }
            },
        )),
    }
}

async fn retrieve(state: &Arc<State>, peer: PeerId, r: Retrieve) -> Reply {
    let (region, keys) =
        match prepare_copy(state, peer, r.region, r.salt, &r.chunks, true, r.wait_slot) {
            Ok(x) => x,
            Err(e) => return e,
        };
    let pin = (r.pin_id != 0).then_some((r.pin_id, region.shard));
    let plans = state.cache.lock().begin_retrieve(region.class, &keys);
    let mut runs = Vec::new();
    let mut reading = Vec::new();
    let mut outcomes = Vec::with_capacity(plans.len());
    for (plan, chunk) in plans.iter().zip(&r.chunks) {
        outcomes.push(match plan {
            Some(p) => {
                region
                    .geometry
                    .push_runs(&chunk.blocks, p.offset, &mut runs);
                reading.push(p.entry);
                RetrieveOutcome::Loaded
            }
            None => RetrieveOutcome::Missing,
        });
    }
    let m = &state.metrics;
    m.retrieve_chunks
        .with_label_values(&["loaded"])
        .inc_by(reading.len() as u64);
    m.retrieve_chunks
        .with_label_values(&["missing"])
        .inc_by((outcomes.len() - reading.len()) as u64);
    if reading.is_empty() {
        state.cache.lock().finish_retrieve(&[], pin);
        return Reply::Retrieve(RetrieveReply {
            outcomes,
            done_slot: None,
        });
    }
    // A retrieve the device refused does not count as a reader of the lookup's pin.
    let settle = move |state: &State, end: CopyEnd| {
        let pin = if end == CopyEnd::NotSubmitted {
            None
        } else {
            pin
        };
        state.cache.lock().finish_retrieve(&reading, pin);
    };
    match copy(state, &region, Direction::H2d, runs, r.wait_slot, settle).await {
        Ok(done_slot) => Reply::Retrieve(RetrieveReply {
            outcomes,
            done_slot,
        }),
        Err(reply) => reply,
    }
}
