//! The server's life: bind everything first (so a busy port fails at once), populate and pin
//! the pool in the background while `/healthz` says so, run the control loop, and on SIGTERM
//! or SIGINT drain and release everything in reverse order.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvd_gpu::{GpuError, PoolMemory};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::devices::{Devices, GpuBackend, PoolPin};
use crate::handler;
use crate::metrics::Metrics;
use crate::router::{PeerId, Router, RouterConfig, RouterEvent, RouterHandle};
use crate::state::{Phase, State, FD_STASH_MAX_AGE};
use crate::wire::frame::{op_name, peek_header};
use crate::wire::{decode_request, encode_reply, DecodeError, ErrorCode, Reply};
use crate::zmtp::{Endpoint, Limits};

/// Time in-flight requests get to finish at shutdown.
const DRAIN_REQUESTS: Duration = Duration::from_secs(3);
/// Time connections get to flush their last replies.
const DRAIN_CONNECTIONS: Duration = Duration::from_secs(1);

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// A listening socket could not be bound.
    #[error("{flag} {value}: {reason}; {fix}")]
    Bind {
        /// The flag that chose it.
        flag: &'static str,
        /// Its value.
        value: String,
        /// The OS's reason.
        reason: String,
        /// What to do.
        fix: &'static str,
    },
    /// The pool could not be made.
    #[error("the L1 pool could not be made: {0}")]
    Pool(String),
}

fn bind_error(
    flag: &'static str,
    value: String,
    e: &dyn std::fmt::Display,
    in_use: bool,
) -> ServeError {
    ServeError::Bind {
        flag,
        value,
        reason: e.to_string(),
        fix: if in_use {
            "pass another value or stop the process that holds it"
        } else {
            "check the address"
        },
    }
}

/// What the server bound, for logs and tests.
#[derive(Debug, Clone)]
pub struct Bound {
    /// ZMQ endpoints.
    pub zmq: Vec<Endpoint>,
    /// HTTP address.
    pub http: SocketAddr,
}

/// Runs kvd until `shutdown` resolves; returns once everything is released.
pub async fn serve(
    config: Config,
    gpu: Result<Arc<dyn GpuBackend>, String>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let metrics = Metrics::new();
    let state = State::new(config.clone(), metrics.clone());
    let stop = CancellationToken::new();
    let connections = TaskTracker::new();
    let requests = TaskTracker::new();

    // Bind everything before any slow work, so a port in use fails the start at once.
    let (events_tx, mut events_rx) = mpsc::channel::<RouterEvent>(4096);
    let mut endpoints = vec![Endpoint::Tcp {
        host: config.host.clone(),
        port: config.port,
    }];
    if let Some(p) = &config.ipc {
        endpoints.push(Endpoint::Ipc(p.clone()));
    }
    let router_config = RouterConfig {
        limits: Limits {
            max_frame_bytes: config.max_frame_bytes,
            ..Limits::default()
        },
        ..RouterConfig::default()
    };
    let router = Router::bind(&endpoints, router_config, events_tx, stop.clone(), &connections)
        .await
        .map_err(|e| {
            let in_use = matches!(&e, crate::zmtp::ZmtpError::Io { source, .. } if source.kind() == std::io::ErrorKind::AddrInUse);
            match (&e, &config.ipc) {
                (crate::zmtp::ZmtpError::Io { context, .. }, Some(p)) if context.contains("ipc://") => {
                    bind_error("--ipc", p.display().to_string(), &e, in_use)
                }
                _ => bind_error("--port", format!("{} ({}:{})", config.port, config.host, config.port), &e, in_use),
            }
        })?;
    let http = tokio::net::TcpListener::bind((config.http_host.as_str(), config.http_port))
        .await
        .map_err(|e| {
            bind_error(
                "--http-port",
                format!(
                    "{} ({}:{})",
                    config.http_port, config.http_host, config.http_port
                ),
                &e,
                e.kind() == std::io::ErrorKind::AddrInUse,
            )
        })?;
    let fd_listener = crate::fdpass::bind(&config.fd_socket).await.map_err(|e| {
        bind_error(
            "--fd-socket",
            config.fd_socket.display().to_string(),
            &e,
            e.kind() == std::io::ErrorKind::AddrInUse,
        )
    })?;
    let bound = Bound {
        zmq: router.endpoints.clone(),
        http: http
            .local_addr()
            .map_err(|e| bind_error("--http-port", config.http_port.to_string(), &e, false))?,
    };
    for ep in &bound.zmq {
        tracing::info!("listening for clients on {ep}");
    }
    tracing::info!("serving /healthz and /metrics on http://{}", bound.http);
    tracing::info!(
        "accepting shared descriptors on {}",
        config.fd_socket.display()
    );

    let (prober, mut probes) = mpsc::channel::<oneshot::Sender<()>>(64);
    connections.spawn(crate::http::serve(
        http,
        state.clone(),
        prober,
        stop.clone(),
        connections.clone(),
    ));
    connections.spawn(crate::fdpass::serve(
        fd_listener,
        state.fds.clone(),
        stop.clone(),
        connections.clone(),
    ));

    // The pool: map, first-touch, pin — on blocking threads, reported through the phase.
    let (fatal_tx, mut fatal_rx) = oneshot::channel::<String>();
    let pin_guard: Arc<parking_lot::Mutex<Option<PoolPin>>> = Arc::default();
    {
        let state = state.clone();
        let pin_guard = pin_guard.clone();
        let gpu = gpu.clone();
        let gpu_for_pool = gpu.clone();
        let state_for_pool = state.clone();
        let built = move || build_pool(&state_for_pool, gpu_for_pool.as_ref().map(|g| g.as_ref()));
        tokio::task::spawn_blocking(move || match built() {
            Ok((pool, pin)) => {
                *pin_guard.lock() = pin;
                let devices = Devices::new(
                    pool,
                    gpu.ok(),
                    state.config.copy_queue,
                    state.metrics.clone(),
                );
                let _ = state.devices.set(devices);
                state
                    .metrics
                    .pool_ready_seconds
                    .set(state.started.elapsed().as_secs_f64());
                state.set_phase(Phase::Ready);
                tracing::info!("ready in {:.2} s", state.started.elapsed().as_secs_f64());
            }
            Err(e) => {
                let msg = format!("{e}; pass a smaller --l1-size-gb");
                state.set_phase(Phase::Failed(msg.clone()));
                let _ = fatal_tx.send(msg);
            }
        });
    }

    let router_handle = router.handle.clone();
    let mut reaper = tokio::time::interval(Duration::from_secs(1));
    reaper.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tokio::pin!(shutdown);
    let mut failure = None;
    let mut pool_pending = true;
    loop {
        tokio::select! {
            _ = &mut shutdown => {
                tracing::info!("shutting down");
                break;
            }
            msg = &mut fatal_rx, if pool_pending => {
                // The sender is dropped unused once the pool is ready.
                pool_pending = false;
                if let Ok(msg) = msg {
                    tracing::error!("{msg}");
                    failure = Some(msg);
                    break;
                }
            }
            Some(ev) = events_rx.recv() => on_event(&state, &router_handle, &requests, ev),
            Some(probe) = probes.recv() => { let _ = probe.send(()); }
            _ = reaper.tick() => reap(&state, &router_handle),
        }
    }

    // Drain: stop reading and accepting; answer what already arrived; let handlers finish.
    state.set_phase(Phase::ShuttingDown);
    stop.cancel();
    while let Ok(ev) = events_rx.try_recv() {
        if let RouterEvent::Message { peer, parts } = ev {
            if let Some(frame) = parts.first() {
                let id = peek_header(frame).map(|h| h.request_id).unwrap_or(0);
                send(
                    &router_handle,
                    peer,
                    id,
                    &Reply::error(
                        ErrorCode::ShuttingDown,
                        "kvd is shutting down; retry against its successor",
                    ),
                );
            }
        }
    }
    requests.close();
    if tokio::time::timeout(DRAIN_REQUESTS, requests.wait())
        .await
        .is_err()
    {
        tracing::warn!("some requests did not finish within {DRAIN_REQUESTS:?}");
    }
    router_handle.close_all();
    connections.close();
    if tokio::time::timeout(DRAIN_CONNECTIONS, connections.wait())
        .await
        .is_err()
    {
        tracing::warn!("some connections did not close within {DRAIN_CONNECTIONS:?}");
    }
    router.unlink_ipc();
    if let Err(e) = std::fs::remove_file(&config.fd_socket) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!("removing {}: {e}", config.fd_socket.display());
        }
    }
    // Release in reverse: sessions (imports), copy workers, pin, pool.
    let ended = state.sessions.lock().close_all();
    for id in ended {
        state.cache.lock().release_owner(id);
    }
    if let Some(devices) = state.devices.get() {
        devices.shutdown();
    }
    pin_guard.lock().take();
    tracing::info!("stopped");
    match failure {
        Some(msg) => Err(ServeError::Pool(msg)),
        None => Ok(()),
    }
}

fn build_pool(
    state: &State,
    gpu: Result<&dyn GpuBackend, &String>,
) -> Result<(Arc<PoolMemory>, Option<PoolPin>), GpuError> {
    let c = &state.config;
    tracing::info!(
        "L1 pool: {:.2} GiB ({}), slabs of {} MiB, {} populate threads",
        c.pool_bytes as f64 / (1u64 << 30) as f64,
        c.size_rule,
        c.slab_bytes >> 20,
        c.populate_threads
    );
    let memory = PoolMemory::allocate(c.pool_bytes, c.hugepages)?;
    state.set_phase(Phase::Populating {
        fraction: 0.0,
        gb_per_s: 0.0,
    });
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let mut last_log = Instant::now();
    let done = memory.first_touch(c.populate_threads, Duration::from_millis(200), &mut |p| {
        state.set_phase(Phase::Populating {
            fraction: p.fraction(),
            gb_per_s: p.gb_per_s(),
        });
        if last_log.elapsed() >= Duration::from_secs(3) {
            last_log = Instant::now();
            tracing::info!(
                "populating L1 pool: {:.1} of {:.1} GiB ({:.0}%), {:.1} GB/s",
                gib(p.done_bytes),
                gib(p.total_bytes),
                p.fraction() * 100.0,
                p.gb_per_s()
            );
        }
    });
    tracing::info!(
        "populated {:.1} GiB in {:.2} s ({:.1} GB/s, {} threads, huge pages {})",
        gib(done.done_bytes),
        done.elapsed.as_secs_f64(),
        done.gb_per_s(),
        c.populate_threads,
        if memory.hugepages() { "advised" } else { "off" }
    );
    let memory = Arc::new(memory);
    let pin = match gpu {
        Ok(gpu) => {
            state.set_phase(Phase::Pinning);
            let t = std::time::Instant::now();
            let pin = gpu.pin_pool(&memory, c.slab_bytes)?;
            let secs = t.elapsed().as_secs_f64();
            tracing::info!(
                "pinned the pool for DMA in {secs:.2} s ({:.1} GB/s)",
                c.pool_bytes as f64 / secs.max(1e-9) / 1e9
            );
            state.metrics.pool_pinned.set(1);
            Some(pin)
        }
        Err(why) => {
            tracing::warn!(
                "no GPU driver found ({why}): the pool stays pageable and only host-memory clients \
                 can register; run kvd where the NVIDIA driver is visible to serve vLLM"
            );
            None
        }
    };
    Ok((memory, pin))
}

fn send(router: &RouterHandle, peer: PeerId, request_id: u64, reply: &Reply) {
    if let Err(e) = router.send(peer, vec![encode_reply(request_id, reply)]) {
        tracing::debug!(peer, "reply not delivered: {e}");
    }
}

fn malformed(
    state: &State,
    router: &RouterHandle,
    peer: PeerId,
    frame: Option<&Bytes>,
    err: &DecodeError,
) {
    let reason = match err {
        DecodeError::FrameTooLarge { .. } => "too_large",
        DecodeError::BadMagic => "bad_magic",
        DecodeError::Version { .. } => "version",
        DecodeError::UnknownKind(_) => "unknown_kind",
        DecodeError::Truncated { .. } | DecodeError::TrailingBytes(_) => "bad_length",
        _ => "bad_field",
    };
    state
        .metrics
        .malformed_frames
        .with_label_values(&[reason])
        .inc();
    let request_id = frame
        .and_then(|f| peek_header(f).ok())
        .map(|h| h.request_id)
        .unwrap_or(0);
    let reply = match err {
        DecodeError::Version { got, want } => Reply::error(
            ErrorCode::VersionMismatch,
            format!("frame speaks kvd protocol {got}; this kvd speaks {want}; install the client package that matches this server"),
        ),
        DecodeError::FrameTooLarge { .. } => Reply::error(
            ErrorCode::Malformed,
            format!("{err}; split the request or start kvd with a larger --max-frame-mb"),
        ),
        _ => Reply::error(ErrorCode::Malformed, format!("malformed frame: {err}")),
    };
    tracing::debug!(peer, request_id, "malformed frame: {err}");
    send(router, peer, request_id, &reply);
}

fn on_event(state: &Arc<State>, router: &RouterHandle, requests: &TaskTracker, ev: RouterEvent) {
    match ev {
        RouterEvent::Connected { peer, info } => {
            let id = state.sessions.lock().open(peer, Instant::now());
            tracing::debug!(peer, session = id, socket_type = %info.socket_type, "connected");
        }
        RouterEvent::Disconnected { peer, reason } => end_session(state, peer, &reason),
        RouterEvent::Oversized { peer, head, len } => {
            let err = DecodeError::FrameTooLarge {
                len: len as usize,
                max: state.config.max_frame_bytes,
            };
            malformed(state, router, peer, Some(&head), &err);
        }
        RouterEvent::Message { peer, parts } => {
            let arrived = Instant::now();
            if parts.len() != 1 {
                let err = DecodeError::BadString("expected a single-part message");
                state
                    .metrics
                    .malformed_frames
                    .with_label_values(&["parts"])
                    .inc();
                let id = parts
                    .first()
                    .and_then(|f| peek_header(f).ok())
                    .map(|h| h.request_id)
                    .unwrap_or(0);
                send(
                    router,
                    peer,
                    id,
                    &Reply::error(
                        ErrorCode::Malformed,
                        format!("malformed message: {err}; send one frame per request"),
                    ),
                );
                return;
            }
            let frame = &parts[0];
            let (request_id, req) = match decode_request(frame, state.config.max_frame_bytes) {
                Ok(v) => v,
                Err(e) => return malformed(state, router, peer, Some(frame), &e),
            };
            if let Some(s) = state.sessions.lock().get_mut(peer) {
                s.last_seen = arrived;
            }
            let op = op_name(req.kind());
            // Requests that never wait are answered in the loop, in arrival order.
            let req = match handler::handle_now(state, peer, req) {
                Ok(reply) => {
                    state
                        .metrics
                        .answered(op, &reply, arrived.elapsed().as_secs_f64());
                    send(router, peer, request_id, &reply);
                    return;
                }
                Err(req) => *req,
            };
            let state = state.clone();
            let router = router.clone();
            requests.spawn(async move {
                let reply = handler::handle(state.clone(), peer, req).await;
                state
                    .metrics
                    .answered(op, &reply, arrived.elapsed().as_secs_f64());
                send(&router, peer, request_id, &reply);
            });
        }
    }
}

fn end_session(state: &State, peer: PeerId, reason: &str) {
    let ended = state.sessions.lock().close(peer);
    if let Some(id) = ended.id {
        let pins = state.cache.lock().release_owner(id);
        tracing::info!(
            session = id,
            "session ended ({reason}): released {pins} pinned chunks and {} registrations",
            ended.regions
        );
        state.refresh_metrics();
    }
}

fn reap(state: &State, router: &RouterHandle) {
    let now = Instant::now();
    let expired = state.cache.lock().expire(now);
    if expired > 0 {
        tracing::debug!("{expired} lookup pins timed out");
    }
    let closed = state.fds.expire(FD_STASH_MAX_AGE);
    if closed > 0 {
        tracing::warn!("closed {closed} shared descriptors that no registration claimed within {FD_STASH_MAX_AGE:?}");
    }
    let cutoff = now.checked_sub(state.config.session_timeout).unwrap_or(now);
    let silent = state.sessions.lock().silent_since(cutoff);
    for peer in silent {
        state.metrics.sessions_timed_out.inc();
        router.disconnect(peer);
        end_session(state, peer, "silent past --session-timeout-ms");
    }
}
