//! A ZMTP ROUTER: accepts DEALER (and REQ) peers on tcp:// and ipc:// endpoints, reports each
//! peer's events to an [`EventSink`] from that peer's own reading task (no shared loop between
//! a request and its handler: one client's traffic never queues behind another's), and sends
//! replies back through a bounded per-peer queue written by that peer's own task, so one slow
//! client never stalls the others.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use kvd_proto::zmtp::codec::{handshake, pong, read_message, write_message, Inbound};
use kvd_proto::zmtp::{Endpoint, Limits, PeerInfo, ZmtpError};

/// A connected peer, numbered in accept order from 1.
pub type PeerId = u64;

/// What the router reports.
#[derive(Debug)]
pub enum RouterEvent {
    /// A peer finished its handshake.
    Connected {
        /// The peer.
        peer: PeerId,
        /// Its READY properties.
        info: PeerInfo,
    },
    /// A message (for REQ peers, without the empty delimiter).
    Message {
        /// The sender.
        peer: PeerId,
        /// Its parts.
        parts: Vec<Bytes>,
    },
    /// A message above the limits, skipped.
    Oversized {
        /// The sender.
        peer: PeerId,
        /// First bytes of its first part.
        head: Bytes,
        /// Size of its largest part.
        len: u64,
    },
    /// A peer's connection ended.
    Disconnected {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: String,
    },
}

/// Where the router reports. Called on the reporting peer's own task, so one peer's events
/// arrive in order (connected, its messages, disconnected); an implementation must not block.
pub trait EventSink: Send + Sync + 'static {
    /// Handles one event; `router` sends the replies.
    fn on_event(&self, router: &RouterHandle, event: RouterEvent);
}

/// Router settings.
#[derive(Debug, Clone, Copy)]
pub struct RouterConfig {
    /// Frame and handshake limits.
    pub limits: Limits,
    /// Replies queued per peer before the peer is judged stuck and disconnected.
    pub peer_queue: usize,
    /// Most simultaneous connections; more are accepted and closed at once.
    pub max_connections: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            limits: Limits::default(),
            peer_queue: 4096,
            max_connections: 4096,
        }
    }
}

enum Outbound {
    Message(Vec<Bytes>),
    Pong(Bytes),
}

struct PeerSlot {
    tx: mpsc::Sender<Outbound>,
    /// REQ peers expect an empty delimiter before each reply.
    delimiter: bool,
    close: CancellationToken,
}

/// Why a reply could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The peer is gone.
    #[error("peer disconnected")]
    Gone,
    /// The peer stopped reading; it has been disconnected.
    #[error("peer stopped reading replies and was disconnected")]
    Stuck,
}

/// Sends to peers; cheap to clone.
#[derive(Clone)]
pub struct RouterHandle {
    peers: Arc<Mutex<HashMap<PeerId, PeerSlot>>>,
}

impl std::fmt::Debug for RouterHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterHandle")
            .field("peers", &self.peers.lock().len())
            .finish()
    }
}

impl RouterHandle {
    /// Queues a message for a peer without waiting.
    pub fn send(&self, peer: PeerId, parts: Vec<Bytes>) -> Result<(), SendError> {
        let mut peers = self.peers.lock();
        let slot = peers.get(&peer).ok_or(SendError::Gone)?;
        let parts = if slot.delimiter {
            std::iter::once(Bytes::new()).chain(parts).collect()
        } else {
            parts
        };
        match slot.tx.try_send(Outbound::Message(parts)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::TrySendError::Closed(_)) => Err(SendError::Gone),
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(peer, "peer stopped reading replies; disconnecting it");
                if let Some(slot) = peers.remove(&peer) {
                    slot.close.cancel();
                }
                Err(SendError::Stuck)
            }
        }
    }

    /// Closes a peer's connection.
    pub fn disconnect(&self, peer: PeerId) {
        if let Some(slot) = self.peers.lock().remove(&peer) {
            slot.close.cancel();
        }
    }

    /// Number of connected peers.
    pub fn peer_count(&self) -> usize {
        self.peers.lock().len()
    }

    /// Drops every peer's queue: writers flush what is queued, then close. Called at shutdown
    /// once every in-flight request has been answered.
    pub fn close_all(&self) {
        self.peers.lock().clear();
    }
}

/// A bound router.
#[derive(Debug)]
pub struct Router {
    /// For sending replies.
    pub handle: RouterHandle,
    /// The endpoints as bound (tcp port 0 resolved).
    pub endpoints: Vec<Endpoint>,
    ipc_paths: Vec<std::path::PathBuf>,
}

impl Router {
    /// Binds every endpoint and starts accepting. Stops accepting and reading when `stop` is
    /// cancelled; tasks are spawned on `tracker`.
    pub async fn bind(
        endpoints: &[Endpoint],
        config: RouterConfig,
        events: Arc<dyn EventSink>,
        stop: CancellationToken,
        tracker: &TaskTracker,
    ) -> Result<Router, ZmtpError> {
        let handle = RouterHandle {
            peers: Arc::new(Mutex::new(HashMap::new())),
        };
        let shared = Arc::new(Shared {
            handle: handle.clone(),
            config,
            events,
            stop,
            next_peer: AtomicU64::new(1),
            slots: Arc::new(Semaphore::new(config.max_connections)),
            tracker: tracker.clone(),
        });
        let mut bound = Vec::new();
        let mut ipc_paths = Vec::new();
        for ep in endpoints {
            match ep {
                Endpoint::Tcp { host, port } => {
                    let listener = TcpListener::bind((host.as_str(), *port))
                        .await
                        .map_err(|e| ZmtpError::io(format!("binding {ep}"), e))?;
                    let port = listener
                        .local_addr()
                        .map_err(|e| ZmtpError::io(format!("binding {ep}"), e))?
                        .port();
                    bound.push(Endpoint::Tcp {
                        host: host.clone(),
                        port,
                    });
                    let s = shared.clone();
                    tracker.spawn(async move {
                        s.accept_loop(|| async {
                            let (stream, _) = listener.accept().await?;
                            stream.set_nodelay(true)?;
                            Ok(stream)
                        })
                        .await
                    });
                }
                Endpoint::Ipc(path) => {
                    remove_stale_socket(path).await?;
                    let listener = UnixListener::bind(path)
                        .map_err(|e| ZmtpError::io(format!("binding {ep}"), e))?;
                    bound.push(ep.clone());
                    ipc_paths.push(path.clone());
                    let s = shared.clone();
                    tracker.spawn(async move {
                        s.accept_loop(|| async { Ok(listener.accept().await?.0) })
                            .await
                    });
                }
            }
        }
        Ok(Router {
            handle,
            endpoints: bound,
            ipc_paths,
        })
    }

    /// Removes the ipc socket files this router bound.
    pub fn unlink_ipc(&self) {
        for path in &self.ipc_paths {
            if let Err(e) = std::fs::remove_file(path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    tracing::warn!("removing {}: {e}", path.display());
                }
            }
        }
    }
}

/// Removes a socket file left by a process that no longer listens on it. A socket someone still
/// listens on is an error: two servers on one path would steal each other's clients.
pub async fn remove_stale_socket(path: &Path) -> Result<(), ZmtpError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(ZmtpError::Endpoint(format!(
            "{} exists and is not a socket; remove it or choose another path",
            path.display()
        )));
    }
    match tokio::net::UnixStream::connect(path).await {
        Ok(_) => Err(ZmtpError::Io {
            context: format!("binding ipc://{}", path.display()),
            source: std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another process is listening on this socket; stop it or choose another path",
            ),
        }),
        Err(_) => {
            tracing::info!("removing stale socket {}", path.display());
            std::fs::remove_file(path)
                .map_err(|e| ZmtpError::io(format!("removing stale {}", path.display()), e))
        }
    }
}

struct Shared {
    handle: RouterHandle,
    config: RouterConfig,
    events: Arc<dyn EventSink>,
    stop: CancellationToken,
    next_peer: AtomicU64,
    slots: Arc<Semaphore>,
    tracker: TaskTracker,
}

impl Shared {
    async fn accept_loop<S, F, Fut>(self: Arc<Self>, accept: F)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::io::Result<S>>,
    {
        let me = self.clone();
        crate::accept::accept_until(
            "ZMQ",
            self.stop.clone(),
            self.tracker.clone(),
            accept,
            move |stream| {
                // A connection over the limit is accepted and closed at once.
                let permit = me.slots.clone().try_acquire_owned();
                let s = me.clone();
                async move {
                    let Ok(permit) = permit else {
                        tracing::warn!(
                            "refusing a connection: {} already open",
                            s.config.max_connections
                        );
                        return;
                    };
                    s.serve(stream).await;
                    drop(permit);
                }
            },
        )
        .await
    }

    async fn serve<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(
        self: Arc<Self>,
        mut stream: S,
    ) {
        let limits = self.config.limits;
        let hs = tokio::time::timeout(
            limits.handshake_timeout,
            handshake(&mut stream, true, "ROUTER", b"", &["DEALER", "REQ"]),
        )
        .await;
        let info = match hs {
            Ok(Ok(info)) => info,
            Ok(Err(e)) => {
                tracing::debug!("handshake failed: {e}");
                return;
            }
            Err(_) => {
                tracing::debug!("{}", ZmtpError::HandshakeTimeout(limits.handshake_timeout));
                return;
            }
        };
        let peer = self.next_peer.fetch_add(1, Ordering::Relaxed);
        let delimiter = info.socket_type.eq_ignore_ascii_case("REQ");
        let (tx, rx) = mpsc::channel(self.config.peer_queue.max(1));
        let close = CancellationToken::new();
        self.handle.peers.lock().insert(
            peer,
            PeerSlot {
                tx: tx.clone(),
                delimiter,
                close: close.clone(),
            },
        );
        let (mut rd, wr) = tokio::io::split(stream);
        let writer_close = close.clone();
        self.tracker.spawn(write_loop(wr, rx, writer_close));
        self.events
            .on_event(&self.handle, RouterEvent::Connected { peer, info });
        let reason = loop {
            let msg = tokio::select! {
                _ = self.stop.cancelled() => break None,
                _ = close.cancelled() => break Some("closed by kvd".to_string()),
                m = read_message(&mut rd, &limits) => m,
            };
            let event = match msg {
                Ok(Inbound::Message(mut parts)) => {
                    if delimiter && parts.first().is_some_and(|p| p.is_empty()) {
                        parts.remove(0);
                    }
                    RouterEvent::Message { peer, parts }
                }
                Ok(Inbound::Oversized { head, len }) => RouterEvent::Oversized { peer, head, len },
                Ok(Inbound::Ping(ctx)) => {
                    let _ = tx.try_send(Outbound::Pong(ctx));
                    continue;
                }
                Err(ZmtpError::Closed) => break Some("peer closed the connection".to_string()),
                Err(e) => break Some(e.to_string()),
            };
            self.events.on_event(&self.handle, event);
        };
        // At shutdown the peer stays registered so in-flight replies still reach it; the
        // server closes all peers once they are answered.
        if let Some(reason) = reason {
            self.handle.disconnect(peer);
            self.events
                .on_event(&self.handle, RouterEvent::Disconnected { peer, reason });
        }
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    wr: W,
    mut rx: mpsc::Receiver<Outbound>,
    close: CancellationToken,
) {
    let mut w = BufWriter::with_capacity(64 * 1024, wr);
    loop {
        let first = tokio::select! {
            m = rx.recv() => m,
            _ = close.cancelled() => None,
        };
        let Some(mut next) = first else { break };
        // Write what is queued, then flush once.
        loop {
            let r = match &next {
                Outbound::Message(parts) => write_message(&mut w, parts).await,
                Outbound::Pong(ctx) => pong(&mut w, ctx).await,
            };
            if r.is_err() {
                close.cancel();
                return;
            }
            match rx.try_recv() {
                Ok(m) => next = m,
                Err(_) => break,
            }
        }
        if w.flush().await.is_err() {
            close.cancel();
            return;
        }
    }
    let _ = w.flush().await;
    let _ = w.shutdown().await;
}
