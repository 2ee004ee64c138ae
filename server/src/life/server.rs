//! The server's life: bind everything first (so a busy port fails at once), populate and pin
//! the pool in the background (serving from its first slabs on, while `/healthz` reports its
//! growth), run the control loop (health probes, timeouts), and on SIGTERM or SIGINT drain and
//! release everything in reverse order. Requests do not pass through the control loop: each
//! connection's task decodes its own and hands them to the handler ([`Dispatcher`]).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::config::Config;
use crate::control::connections::{reap, Dispatcher};
use crate::control::fdpass::FdStash;
use crate::control::router::{Router, RouterConfig};
use crate::control::state::{Phase, Settings, State};
use crate::data::devices::{GpuBackend, PoolPin};
use crate::l1::cache::Cache;
use crate::l1::numa::{NumaMode, Placement};
use crate::l1::pool::PagePool;
use crate::l1::presence::Presence;
use crate::l1::L1;
use crate::life::health::Health;
use crate::ops::metrics::Metrics;
use crate::tiers::chain::Tiers;
use crate::tiers::l2::L2Tier;
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
    /// The disk tier could not be set up.
    #[error(transparent)]
    Disk(#[from] crate::tiers::disk::DiskError),
    /// The L2 tier could not be set up.
    #[error("{0}")]
    L2(#[from] crate::tiers::l2::L2Error),
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

/// A socket path (`--ipc`, `--fd-socket`) that could not be bound: the reason as the OS or
/// kvd's checks gave it, and one fix chosen by its kind.
fn socket_path_error(flag: &'static str, path: &std::path::Path, e: &std::io::Error) -> ServeError {
    use std::io::ErrorKind::{AddrInUse, AlreadyExists, NotFound, PermissionDenied};
    ServeError::Bind {
        flag,
        value: path.display().to_string(),
        reason: e.to_string(),
        fix: match e.kind() {
            AddrInUse => "stop it, or pass another path",
            AlreadyExists => "remove it, or pass another path",
            NotFound => "create it, or pass a path in an existing directory",
            PermissionDenied => {
                "give kvd's user write access to the directory, or pass another path"
            }
            _ => "pass another path",
        },
    }
}

/// The flag to blame for a TCP bind that failed with `kind`: the port when it is taken or
/// needs privilege, else the address (unknown, not this machine's, not parseable).
fn tcp_bind_error(
    (host_flag, host): (&'static str, &str),
    (port_flag, port): (&'static str, u16),
    e: &std::io::Error,
    message: &dyn std::fmt::Display,
) -> ServeError {
    use std::io::ErrorKind::{AddrInUse, PermissionDenied};
    match e.kind() {
        AddrInUse => bind_error(port_flag, format!("{port} ({host}:{port})"), message, true),
        PermissionDenied => ServeError::Bind {
            flag: port_flag,
            value: port.to_string(),
            reason: message.to_string(),
            fix: "ports below 1024 need root or CAP_NET_BIND_SERVICE; pass a higher port",
        },
        _ => ServeError::Bind {
            flag: host_flag,
            value: host.to_string(),
            reason: message.to_string(),
            fix: "give an IP address of this machine (127.0.0.1, 0.0.0.0 for all) or a name \
                  that resolves to one",
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

/// Runs kvd until `shutdown` resolves; returns once everything is released. The same as
/// [`bind`] then [`Listening::serve`].
pub async fn serve(
    config: Config,
    gpu: Result<GpuBackend, String>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    bind(config).await?.serve(gpu, shutdown).await
}

/// A kvd whose sockets are bound (so a busy port has already failed) and that serves nothing
/// yet; [`Listening::bound`] says where it listens, which lets a test start a server in-process
/// on port 0 and connect to it. Serve it with [`Listening::serve`].
#[derive(Debug)]
pub struct Listening {
    config: Config,
    metrics: Metrics,
    state: Arc<State>,
    stop: CancellationToken,
    connections: TaskTracker,
    requests: TaskTracker,
    l2: Option<Arc<L2Tier>>,
    router: Router,
    http: tokio::net::TcpListener,
    fd_listener: tokio::net::UnixListener,
    bound: Bound,
}

/// Binds every socket kvd serves on, before any slow work.
pub async fn bind(config: Config) -> Result<Listening, ServeError> {
    let metrics = Metrics::new();
    let state = shared_state(&config, &metrics);
    let stop = CancellationToken::new();
    let connections = TaskTracker::new();
    let requests = TaskTracker::new();

    // The L2 adapter first: it only checks its settings (connections are made in the
    // background), and failing here leaves no socket behind.
    let l2 = crate::tiers::l2::open(config.l2.as_ref(), &metrics)?;

    // Bind everything before any slow work, so a port in use fails the start at once.
    let dispatcher = Arc::new(Dispatcher::new(state.clone(), requests.clone()));
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
        max_connections: config.max_connections,
        hello_timeout: config.hello_timeout,
        max_in_flight: config.max_in_flight,
        max_buffered_bytes: config.max_buffered_bytes,
        ..RouterConfig::default()
    };
    let router = Router::bind(
        &endpoints,
        router_config,
        dispatcher,
        stop.clone(),
        &connections,
        metrics.clone(),
    )
    .await
    .map_err(|e| match &e {
        crate::zmtp::ZmtpError::Io { context, source } => match &config.ipc {
            Some(p) if context.contains("ipc://") => socket_path_error("--ipc", p, source),
            _ => tcp_bind_error(
                ("--host", &config.host),
                ("--port", config.port),
                source,
                &e,
            ),
        },
        _ => bind_error("--port", config.port.to_string(), &e, false),
    })?;
    let rest = async {
        let http = tokio::net::TcpListener::bind((config.http_host.as_str(), config.http_port))
            .await
            .map_err(|e| {
                tcp_bind_error(
                    ("--http-host", &config.http_host),
                    ("--http-port", config.http_port),
                    &e,
                    &e,
                )
            })?;
        let fd_listener = crate::control::fdpass::bind(&config.fd_socket, config.fd_socket_mode)
            .await
            .map_err(|e| socket_path_error("--fd-socket", &config.fd_socket, &e))?;
        let addr = http
            .local_addr()
            .map_err(|e| bind_error("--http-port", config.http_port.to_string(), &e, false))?;
        Ok::<_, ServeError>((http, fd_listener, addr))
    }
    .await;
    let (http, fd_listener, http_addr) = match rest {
        Ok(v) => v,
        Err(e) => {
            // The ipc socket file is kvd's own: never leave it behind.
            router.unlink_ipc();
            return Err(e);
        }
    };
    let bound = Bound {
        zmq: router.endpoints.clone(),
        http: http_addr,
    };
    for ep in &bound.zmq {
        tracing::info!("listening for clients on {ep}");
    }
    tracing::info!("serving /healthz and /metrics on http://{}", bound.http);
    tracing::info!(
        "accepting shared descriptors on {}",
        config.fd_socket.display()
    );
    Ok(Listening {
        config,
        metrics,
        state,
        stop,
        connections,
        requests,
        l2,
        router,
        http,
        fd_listener,
        bound,
    })
}

impl Listening {
    /// Where the server listens.
    pub fn bound(&self) -> &Bound {
        &self.bound
    }

    /// Serves until `shutdown` resolves, with `gpu` for the pool's pinning and GPU devices;
    /// returns once everything is released.
    pub async fn serve(
        self,
        gpu: Result<GpuBackend, String>,
        shutdown: impl Future<Output = ()>,
    ) -> Result<(), ServeError> {
        let Listening {
            config,
            metrics,
            state,
            stop,
            connections,
            requests,
            l2,
            router,
            http,
            fd_listener,
            bound: _,
        } = self;
        if let Some(l2) = &l2 {
            l2.start(state.l1.clone(), stop.clone(), &connections);
        }
        let disk = crate::tiers::disk::open(config.disk.as_ref(), &metrics)?;
        if let Some(disk) = &disk {
            disk.start(state.l1.clone(), state.clone())
                .map_err(|e| ServeError::Pool(format!("starting the disk tier's threads: {e}")))?;
        }
        let _ = state.tiers.set(Tiers::new(disk, l2));

        let (prober, mut probes) = mpsc::channel::<oneshot::Sender<()>>(64);
        let site = Arc::new(Health {
            state: state.clone(),
            prober,
        });
        connections.spawn(crate::ops::http::serve(
            http,
            site,
            stop.clone(),
            connections.clone(),
        ));
        connections.spawn(crate::control::fdpass::serve(
            fd_listener,
            state.fds.clone(),
            config.fd_limits,
            metrics.clone(),
            stop.clone(),
            connections.clone(),
        ));

        // The pool: map, then first-touch and pin in steps on a blocking thread; kvd serves from
        // the first step on (see `grow`).
        let (fatal_tx, mut fatal_rx) = oneshot::channel::<String>();
        let pins: Arc<parking_lot::Mutex<Vec<PoolPin>>> = Arc::default();
        let grower = {
            let (state, config, pins, stop) =
                (state.clone(), config.clone(), pins.clone(), stop.clone());
            tokio::task::spawn_blocking(move || {
                crate::life::grow::grow(&state, &config, gpu, &stop, &pins, fatal_tx)
            })
        };

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
                    // The sender is dropped unused once the first slabs are ready.
                    pool_pending = false;
                    if let Ok(msg) = msg {
                        tracing::error!("{msg}");
                        failure = Some(msg);
                        break;
                    }
                }
                Some(probe) = probes.recv() => {
                    // Requests run on the connections' tasks, not here: a probe answered here shows
                    // the runtime schedules tasks and the state every request takes is not wedged.
                    drop(state.sessions.lock());
                    drop(state.l1.cache());
                    let _ = probe.send(());
                }
                _ = reaper.tick() => reap(&state, &router_handle),
            }
        }

        // Drain: stop reading and accepting; let registrations and copies in flight finish and
        // answer; then close the connections once their replies are written.
        state.set_phase(Phase::ShuttingDown);
        stop.cancel();
        requests.close();
        if tokio::time::timeout(DRAIN_REQUESTS, requests.wait())
            .await
            .is_err()
        {
            tracing::warn!("some requests did not finish within {DRAIN_REQUESTS:?}");
        }
        // The disk tier's threads read the pool: they stop, and its index is saved, first.
        if let Some(disk) = state.tiers.get().and_then(|t| t.disk.clone()) {
            let _ = tokio::task::spawn_blocking(move || disk.stop()).await;
        }
        // Queued copies complete and their requests are answered before the workers stop.
        let workers = state.clone();
        let _ = tokio::task::spawn_blocking(move || {
            if let Some(devices) = workers.devices.get() {
                devices.shutdown();
            }
        })
        .await;
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
        // The grower stops between steps once `stop` is cancelled.
        if let Err(e) = grower.await {
            tracing::error!("the pool's growth thread failed: {e}");
        }
        // Release in reverse: sessions (imports; the copy workers stopped above), pins, pool.
        let ended = state.sessions.lock().close_all();
        for id in ended {
            state.l1.cache().release_owner(id);
        }
        // Unpin the newest pieces first.
        while pins.lock().pop().is_some() {}
        tracing::info!("stopped");
        match failure {
            Some(msg) => Err(ServeError::Pool(msg)),
            None => Ok(()),
        }
    }
}

/// The state requests share, from the settings: L1 over a pool that grows from no slabs (its
/// NUMA placement chosen here), the fd stash, and the settings requests are answered with.
fn shared_state(config: &Config, metrics: &Metrics) -> Arc<State> {
    let mut pool = PagePool::growing(&config.layout);
    let placement = match config.numa {
        NumaMode::Off => None,
        NumaMode::Auto | NumaMode::Remote => Placement::new(&config.layout, &config.topology),
    };
    if let Some(p) = &placement {
        pool.set_homes(p.homes(), |slab| p.home_of_piece(slab));
    }
    metrics.pool_bytes.set(pool.total_bytes() as i64);
    let mut cache = Cache::new(pool, config.eviction)
        .with_feed_capacity(config.events_capacity)
        .with_lookup_pin_frac(config.lookup_pin_frac)
        .with_lookup_holds(config.lookup_hold_frac, config.lookup_hold);
    // Only a filter of everything kvd may hold is one clients can skip a lookup on: with a disk
    // or an L2 below L1, a lookup may find what L1 lacks.
    if let Some(dir) = config
        .presence_dir
        .as_ref()
        .filter(|_| config.disk.is_none() && config.l2.is_none())
    {
        match Presence::create(dir, config.layout.size_bytes()) {
            Ok(p) => {
                tracing::info!(
                    "presence filter {} ({} KiB): connectors on this host skip lookups that would find nothing",
                    p.path().display(),
                    p.bytes() >> 10
                );
                cache = cache.with_presence(p);
            }
            Err(e) => tracing::warn!(
                "no presence filter in {} ({e}); connectors ask kvd on every lookup. Give --presence-dir a \
                 writable folder on a memory file system (or `off`)",
                dir.display()
            ),
        }
    }
    let fds = FdStash::new(
        config.fd_limits.max_stashed,
        config.fd_limits.max_stashed_per_uid,
        config.fd_limits.own_uid,
    );
    let settings = Settings {
        chunk_tokens: config.chunk_tokens,
        fd_socket: config.fd_socket.clone(),
        pin_timeout: config.pin_timeout,
        session_timeout: config.session_timeout,
        max_frame_bytes: config.max_frame_bytes,
        max_buffered_bytes: config.max_buffered_bytes,
        layout: config.layout,
        recall_bytes: config.recall_bytes,
    };
    State::new(settings, metrics.clone(), L1::new(cache, placement), fds)
}
