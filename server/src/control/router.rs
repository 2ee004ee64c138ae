//! A ZMTP ROUTER: accepts DEALER (and REQ) peers on tcp:// and ipc:// endpoints, reports each
//! peer's events to an [`EventSink`] from that peer's own reading task (no shared loop between
//! a request and its handler: one client's traffic never queues behind another's), and sends
//! replies back through a bounded per-peer queue written by that peer's own task, so one slow
//! client never stalls the others.
//!
//! What one peer can cost is bounded here, before any request is decoded:
//! - connections: at most `max_connections`. A connection is *anonymous* until the server calls
//!   [`RouterHandle::identified`] (its hello was accepted); anonymous ones are closed after
//!   `hello_timeout`, and when the table is full a newcomer takes the slot of the oldest
//!   anonymous connection, so thousands of silent connections cannot lock identified clients out;
//! - requests: at most `max_in_flight` per connection between being read and being answered
//!   (each message carries a [`Ticket`]); the connection is not read further until one is
//!   answered, so one client pipelining heavy requests holds at most that many of kvd's copy
//!   queue slots and buffers;
//! - memory: every message's bytes come from one budget of `max_buffered_bytes` shared by all
//!   connections, a message must arrive whole within `message_timeout`, and a message above the
//!   frame limit is skipped unbuffered;
//! - a peer that stops reading replies: when its queue of `peer_queue` replies is full it is
//!   closed, writer included, and its descriptor released at once.
//!
//! A connection whose handshake fails (bytes that are not ZMTP, a socket type kvd cannot talk
//! to, no handshake in time) is counted and logged by [`crate::control::refused`].

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use kvd_proto::zmtp::codec::{handshake, pong, read_message_within, write_message, Inbound};
use kvd_proto::zmtp::{Budget, Endpoint, Limits, Oversize, PeerInfo, ZmtpError};

use crate::control::refused::{reason_of, RefusalLog};
use crate::ops::metrics::Metrics;

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
        /// The peer's in-flight slot and the message's buffer budget: keep it until the reply
        /// is queued.
        ticket: Ticket,
    },
    /// A message refused by a limit, skipped unbuffered.
    Oversized {
        /// The sender.
        peer: PeerId,
        /// First bytes of its first part.
        head: Bytes,
        /// Size of its largest part, or of the whole message.
        len: u64,
        /// Which limit.
        reason: Oversize,
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

/// Holds one of a peer's in-flight slots and its message's share of the buffer budget until
/// dropped: the server keeps it until the request's reply is queued.
#[derive(Debug)]
pub struct Ticket {
    _slot: OwnedSemaphorePermit,
    _bytes: Vec<OwnedSemaphorePermit>,
}

/// Router settings.
#[derive(Debug, Clone, Copy)]
pub struct RouterConfig {
    /// Frame and handshake limits.
    pub limits: Limits,
    /// Replies queued per peer before the peer is judged stuck and disconnected.
    pub peer_queue: usize,
    /// Most simultaneous connections (`--max-connections`).
    pub max_connections: usize,
    /// Time a connection has from accept to an accepted hello (`--hello-timeout-ms`).
    pub hello_timeout: Duration,
    /// Requests per connection read and not yet answered (`--max-in-flight`).
    pub max_in_flight: usize,
    /// Bytes of received, unanswered messages across all connections (`--max-buffered-mb`).
    pub max_buffered_bytes: usize,
    /// Time a message has, once begun, to arrive whole.
    pub message_timeout: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            limits: Limits::default(),
            peer_queue: 4096,
            max_connections: 4096,
            hello_timeout: Duration::from_secs(3),
            max_in_flight: 8,
            max_buffered_bytes: 256 << 20,
            message_timeout: Duration::from_secs(30),
        }
    }
}

/// One open connection, from accept until both its reader and its writer are done.
#[derive(Debug)]
struct Conn {
    close: CancellationToken,
    identified: AtomicBool,
}

/// Every open connection; anonymous ones (no accepted hello yet) in accept order.
#[derive(Debug, Default)]
struct Conns {
    open: HashMap<PeerId, Arc<Conn>>,
    anonymous: BTreeSet<PeerId>,
}

/// Removes its connection from the table when the last of its tasks ends.
struct ConnGuard {
    peer: PeerId,
    conn: Arc<Conn>,
    conns: Arc<Mutex<Conns>>,
    metrics: Metrics,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        let mut c = self.conns.lock();
        // An evicted connection was removed already, and its id is never reused.
        if c.open.remove(&self.peer).is_some() {
            c.anonymous.remove(&self.peer);
        }
        self.metrics.connections.set(c.open.len() as i64);
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
    conns: Arc<Mutex<Conns>>,
    metrics: Metrics,
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
                self.metrics
                    .connections_closed
                    .with_label_values(&["not_reading"])
                    .inc();
                Err(SendError::Stuck)
            }
        }
    }

    /// Marks a peer as identified (its hello was accepted): it no longer has a hello deadline
    /// and can no longer be displaced by a newcomer.
    pub fn identified(&self, peer: PeerId) {
        let mut c = self.conns.lock();
        if let Some(conn) = c.open.get(&peer) {
            conn.identified.store(true, Ordering::Release);
            c.anonymous.remove(&peer);
        }
    }

    /// Open connections, including those still in their handshake.
    pub fn connection_count(&self) -> usize {
        self.conns.lock().open.len()
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
        metrics: Metrics,
    ) -> Result<Router, ZmtpError> {
        let handle = RouterHandle {
            peers: Arc::new(Mutex::new(HashMap::new())),
            conns: Arc::default(),
            metrics,
        };
        let shared = Arc::new(Shared {
            handle: handle.clone(),
            config,
            events,
            stop,
            next_peer: AtomicU64::new(1),
            budget: Arc::new(Semaphore::new(config.max_buffered_bytes)),
            tracker: tracker.clone(),
            refusals: RefusalLog::default(),
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
                            let (stream, peer) = listener.accept().await?;
                            stream.set_nodelay(true)?;
                            Ok((stream, peer.to_string()))
                        })
                        .await
                    });
                }
                Endpoint::Ipc(path) => {
                    check_socket_dir(path)
                        .map_err(|e| ZmtpError::io(format!("binding {ep}"), e))?;
                    remove_stale_socket(path).await?;
                    let listener = UnixListener::bind(path)
                        .map_err(|e| ZmtpError::io(format!("binding {ep}"), e))?;
                    bound.push(ep.clone());
                    ipc_paths.push(path.clone());
                    let s = shared.clone();
                    // A Unix peer has no address: name the socket it came through.
                    let name = format!("a local process on {ep}");
                    tracker.spawn(async move {
                        s.accept_loop(|| async { Ok((listener.accept().await?.0, name.clone())) })
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

/// A socket path's directory must exist: kvd creates none, for `--ipc` and `--fd-socket` alike.
pub fn check_socket_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => return Ok(()),
    };
    if dir.is_dir() {
        return Ok(());
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::NotFound,
        format!(
            "the directory {} does not exist (kvd creates none)",
            dir.display()
        ),
    ))
}

/// Removes a socket file left by a process that no longer listens on it. A socket someone still
/// listens on is an error: two servers on one path would steal each other's clients. The errors
/// say what is wrong, not what to do: the caller knows the flag and adds the fix once
/// (`server::socket_path_error`), by the error's kind.
pub async fn remove_stale_socket(path: &Path) -> Result<(), ZmtpError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    if !meta.file_type().is_socket() {
        return Err(ZmtpError::Io {
            context: format!("binding ipc://{}", path.display()),
            source: std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "the path exists and is not a socket",
            ),
        });
    }
    match tokio::net::UnixStream::connect(path).await {
        Ok(_) => Err(ZmtpError::Io {
            context: format!("binding ipc://{}", path.display()),
            source: std::io::Error::new(
                std::io::ErrorKind::AddrInUse,
                "another process (another kvd?) is listening on this socket",
            ),
        }),
        Err(_) => {
            tracing::info!("removing stale socket {}", path.display());
            std::fs::remove_file(path).map_err(|e| ZmtpError::Io {
                context: format!("binding ipc://{}", path.display()),
                source: std::io::Error::new(
                    e.kind(),
                    format!("removing the stale socket there: {e}"),
                ),
            })
        }
    }
}

struct Shared {
    handle: RouterHandle,
    config: RouterConfig,
    events: Arc<dyn EventSink>,
    stop: CancellationToken,
    next_peer: AtomicU64,
    budget: Budget,
    tracker: TaskTracker,
    refusals: RefusalLog,
}

impl Shared {
    /// Takes a slot for a new connection: a free one, else the oldest anonymous connection's
    /// (which is closed); `None` when every slot holds an identified client.
    fn admit(&self) -> Option<ConnGuard> {
        let peer = self.next_peer.fetch_add(1, Ordering::Relaxed);
        let m = &self.handle.metrics;
        let mut c = self.handle.conns.lock();
        if c.open.len() >= self.config.max_connections {
            let oldest = c.anonymous.pop_first()?;
            if let Some(conn) = c.open.remove(&oldest) {
                conn.close.cancel();
            }
            m.connections_closed
                .with_label_values(&["displaced_anonymous"])
                .inc();
        }
        let conn = Arc::new(Conn {
            close: CancellationToken::new(),
            identified: AtomicBool::new(false),
        });
        c.open.insert(peer, conn.clone());
        c.anonymous.insert(peer);
        m.connections.set(c.open.len() as i64);
        Some(ConnGuard {
            peer,
            conn,
            conns: self.handle.conns.clone(),
            metrics: m.clone(),
        })
    }

    async fn accept_loop<S, F, Fut>(self: Arc<Self>, accept: F)
    where
        S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = std::io::Result<(S, String)>>,
    {
        let me = self.clone();
        crate::ops::accept::accept_until(
            "ZMQ",
            self.stop.clone(),
            self.tracker.clone(),
            accept,
            move |(stream, peer_addr)| {
                // A connection over the limit is accepted and closed at once.
                let guard = me.admit();
                let s = me.clone();
                async move {
                    let Some(guard) = guard else {
                        s.handle
                            .metrics
                            .connections_closed
                            .with_label_values(&["full"])
                            .inc();
                        tracing::warn!(
                            "refusing a connection: {} identified clients already connected \
                             (--max-connections)",
                            s.config.max_connections
                        );
                        return;
                    };
                    s.serve(stream, peer_addr, Arc::new(guard)).await;
                }
            },
        )
        .await
    }

    async fn serve<S: AsyncRead + AsyncWrite + Send + Unpin + 'static>(
        self: Arc<Self>,
        mut stream: S,
        peer_addr: String,
        guard: Arc<ConnGuard>,
    ) {
        let limits = self.config.limits;
        let peer = guard.peer;
        let close = guard.conn.close.clone();
        let hello_deadline = tokio::time::sleep(self.config.hello_timeout);
        tokio::pin!(hello_deadline);
        let hs = tokio::select! {
            _ = close.cancelled() => return,
            _ = self.stop.cancelled() => return,
            r = tokio::time::timeout(
                limits.handshake_timeout,
                handshake(&mut stream, true, "ROUTER", b"", &["DEALER", "REQ"]),
            ) => r,
        };
        let info = match hs.unwrap_or(Err(ZmtpError::HandshakeTimeout(limits.handshake_timeout))) {
            Ok(info) => info,
            Err(e) => {
                match reason_of(&e) {
                    Some(reason) => {
                        self.handle
                            .metrics
                            .connections_closed
                            .with_label_values(&[reason])
                            .inc();
                        self.refusals.refused(&peer_addr, reason, &e);
                    }
                    None => tracing::debug!("handshake with {peer_addr} failed: {e}"),
                }
                return;
            }
        };
        let delimiter = info.socket_type.eq_ignore_ascii_case("REQ");
        let (tx, rx) = mpsc::channel(self.config.peer_queue.max(1));
        self.handle.peers.lock().insert(
            peer,
            PeerSlot {
                tx: tx.clone(),
                delimiter,
                close: close.clone(),
            },
        );
        let (mut rd, wr) = tokio::io::split(stream);
        self.tracker
            .spawn(write_loop(wr, rx, close.clone(), guard.clone()));
        self.events
            .on_event(&self.handle, RouterEvent::Connected { peer, info });
        let in_flight = Arc::new(Semaphore::new(self.config.max_in_flight.max(1)));
        let mut slot: Option<OwnedSemaphorePermit> = None;
        let reason = loop {
            // Wait for one of this peer's in-flight slots before reading its next message.
            if slot.is_none() {
                slot = tokio::select! {
                    _ = self.stop.cancelled() => break None,
                    _ = close.cancelled() => break Some("closed by kvd".to_string()),
                    _ = &mut hello_deadline, if !guard.conn.identified.load(Ordering::Acquire) => {
                        break Some(self.no_hello());
                    }
                    p = in_flight.clone().acquire_owned() => p.ok(),
                };
            }
            let msg = tokio::select! {
                _ = self.stop.cancelled() => break None,
                _ = close.cancelled() => break Some("closed by kvd".to_string()),
                _ = &mut hello_deadline, if !guard.conn.identified.load(Ordering::Acquire) => {
                    break Some(self.no_hello());
                }
                m = read_message_within(&mut rd, &limits, &self.budget, self.config.message_timeout) => m,
            };
            let event = match msg {
                Ok((Inbound::Message(mut parts), bytes)) => {
                    if delimiter && parts.first().is_some_and(|p| p.is_empty()) {
                        parts.remove(0);
                    }
                    let Some(slot) = slot.take() else { continue };
                    RouterEvent::Message {
                        peer,
                        parts,
                        ticket: Ticket {
                            _slot: slot,
                            _bytes: bytes,
                        },
                    }
                }
                Ok((Inbound::Oversized { head, len, reason }, _)) => RouterEvent::Oversized {
                    peer,
                    head,
                    len,
                    reason,
                },
                Ok((Inbound::Ping(ctx), _)) => {
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
            close.cancel();
            self.events
                .on_event(&self.handle, RouterEvent::Disconnected { peer, reason });
        }
    }

    fn no_hello(&self) -> String {
        self.handle
            .metrics
            .connections_closed
            .with_label_values(&["no_hello"])
            .inc();
        format!(
            "no hello within {} ms (--hello-timeout-ms)",
            self.config.hello_timeout.as_millis()
        )
    }
}

/// Writes a peer's replies. Every write also waits on `close`, so a peer that stops reading
/// (its socket buffer full) is dropped the moment kvd closes it, descriptor and all; the guard
/// keeps the connection counted until then.
async fn write_loop<W: AsyncWrite + Unpin>(
    wr: W,
    mut rx: mpsc::Receiver<Outbound>,
    close: CancellationToken,
    _guard: Arc<ConnGuard>,
) {
    let mut w = BufWriter::with_capacity(64 * 1024, wr);
    let written = async {
        loop {
            let Some(mut next) = rx.recv().await else {
                break;
            };
            // Write what is queued, then flush once.
            loop {
                match &next {
                    Outbound::Message(parts) => write_message(&mut w, parts).await?,
                    Outbound::Pong(ctx) => pong(&mut w, ctx).await?,
                }
                match rx.try_recv() {
                    Ok(m) => next = m,
                    Err(_) => break,
                }
            }
            w.flush().await?;
        }
        w.shutdown().await
    };
    tokio::select! {
        r = written => if r.is_err() { close.cancel(); },
        _ = close.cancelled() => {}
    }
}
