//! The kvd client: a DEALER connection with many requests in flight, matched to replies by
//! request id, a timeout on every request, and a heartbeat that keeps the session alive. Tests,
//! benches and the `kvd._native` Python module all use it, so the server is only ever spoken to
//! through the same wire types it was built from.
//!
//! A request is written by the task or thread that makes it (under a lock on the connection's
//! write half), and its reply is handed by the reading task straight to the request's
//! [`OnReply`]: no task sits between a caller and the socket, since each hand-off is a
//! cross-CPU wake-up that a one-request-in-flight copy pays in full.
//!
//! A broken connection fails every pending request at once with [`ClientError::Disconnected`];
//! reconnecting (and registering again) is the owner's decision.

use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::wire::*;
use crate::zmtp::dealer::{self, DealerWriter};
use crate::zmtp::{Endpoint, Limits, ZmtpError};

/// Client failures.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// Could not connect or handshake.
    #[error("cannot reach kvd at {endpoint}: {reason}")]
    Connect {
        /// Where.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// No reply in time.
    #[error("kvd did not answer a {op} request within {after:?}")]
    Timeout {
        /// The request kind.
        op: &'static str,
        /// The timeout.
        after: Duration,
    },
    /// The connection broke.
    #[error("connection to kvd lost: {0}")]
    Disconnected(String),
    /// kvd answered with an error.
    #[error("kvd refused the request ({code:?}): {message}")]
    Server {
        /// Error code.
        code: ErrorCode,
        /// kvd's message.
        message: String,
    },
    /// kvd answered with something unexpected.
    #[error("unexpected reply from kvd: {0}")]
    Protocol(String),
    /// Sharing descriptors failed.
    #[error("sharing descriptors with kvd: {0}")]
    FdPass(String),
}

/// How to connect.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// `tcp://host:port` or `ipc:///path`.
    pub endpoint: String,
    /// Name for kvd's logs.
    pub name: String,
    /// What this client is.
    pub role: Role,
    /// Time to connect and say hello.
    pub connect_timeout: Duration,
    /// Time to wait for each reply.
    pub request_timeout: Duration,
    /// Ping in the background so that an idle session is not closed.
    pub heartbeat: bool,
    /// Overrides the fd socket path kvd announces (when client and kvd see the socket under
    /// different paths, e.g. different container mounts).
    pub fd_socket: Option<PathBuf>,
}

impl ClientConfig {
    /// Defaults for an endpoint: 5 s to connect, 30 s per request, heartbeat on.
    pub fn new(endpoint: impl Into<String>, name: impl Into<String>, role: Role) -> Self {
        ClientConfig {
            endpoint: endpoint.into(),
            name: name.into(),
            role,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            heartbeat: true,
            fd_socket: None,
        }
    }
}

/// Receives a request's reply, or the error that ended its connection; called once, on the
/// client's reading task (or on the caller's, when the request could not be sent).
pub type OnReply = Box<dyn FnOnce(Result<Reply, ClientError>) + Send>;

type Pending = Arc<Mutex<HashMap<u64, OnReply>>>;

struct Inner {
    writer: tokio::sync::Mutex<DealerWriter>,
    pending: Pending,
    next_id: AtomicU64,
    alive: Arc<AtomicBool>,
    config: ClientConfig,
    hello: HelloOk,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// A connected, greeted client. Cheap to clone; the connection closes when the last clone goes.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.inner.config.endpoint)
            .field("session", &self.inner.hello.session_id)
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }
}

fn fail_all(pending: &Pending, why: &str) {
    let failed: Vec<OnReply> = pending.lock().drain().map(|(_, f)| f).collect();
    for f in failed {
        f(Err(ClientError::Disconnected(why.to_string())));
    }
}

impl Client {
    /// Connects and says hello. Must run inside a tokio runtime.
    pub async fn connect(config: ClientConfig) -> Result<Client, ClientError> {
        let connect_err = |reason: String| ClientError::Connect {
            endpoint: config.endpoint.clone(),
            reason,
        };
        let endpoint = Endpoint::parse(&config.endpoint).map_err(|e| connect_err(e.to_string()))?;
        let identity = format!("{}-{}", config.name, std::process::id());
        let limits = Limits {
            max_frame_bytes: 64 << 20,
            ..Limits::default()
        };
        let (mut rd, mut wr, _) = dealer::connect(
            &endpoint,
            identity.as_bytes(),
            limits,
            config.connect_timeout,
        )
        .await
        .map_err(|e| connect_err(e.to_string()))?;

        // Hello before anything else, synchronously on the fresh connection.
        let hello = Request::Hello(Hello {
            protocol_version: PROTOCOL_VERSION as u16,
            client: config.name.clone(),
            pid: std::process::id(),
            role: config.role,
        });
        wr.send(&[encode_request(0, &hello)])
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        let parts = tokio::time::timeout(config.connect_timeout, rd.recv())
            .await
            .map_err(|_| connect_err("no answer to hello".into()))?
            .map_err(|e| connect_err(e.to_string()))?;
        let frame = parts
            .first()
            .ok_or_else(|| connect_err("empty reply to hello".into()))?;
        let hello = match decode_reply(frame, limits.max_frame_bytes) {
            Ok((_, Reply::Hello(h))) => h,
            Ok((_, Reply::Error(e))) => {
                return Err(ClientError::Server {
                    code: e.code,
                    message: e.message,
                })
            }
            Ok((_, other)) => {
                return Err(ClientError::Protocol(format!(
                    "{other:?} in answer to hello"
                )))
            }
            Err(e) => return Err(connect_err(format!("bad hello reply: {e}"))),
        };

        let pending: Pending = Arc::default();
        let alive = Arc::new(AtomicBool::new(true));
        let reader = {
            let pending = pending.clone();
            let alive = alive.clone();
            tokio::spawn(async move {
                loop {
                    let parts = match rd.recv().await {
                        Ok(p) => p,
                        Err(e) => {
                            alive.store(false, Ordering::SeqCst);
                            let why = match e {
                                ZmtpError::Closed => "kvd closed the connection".to_string(),
                                e => e.to_string(),
                            };
                            fail_all(&pending, &why);
                            return;
                        }
                    };
                    let Some(frame) = parts.first() else { continue };
                    match decode_reply(frame, limits.max_frame_bytes) {
                        Ok((id, reply)) => {
                            let waiting = pending.lock().remove(&id);
                            if let Some(on_reply) = waiting {
                                on_reply(Ok(reply));
                            } else if let Reply::Error(e) = reply {
                                tracing::warn!("kvd error for no pending request: {}", e.message);
                            }
                        }
                        Err(e) => tracing::warn!("undecodable reply from kvd: {e}"),
                    }
                }
            })
        };
        let inner = Arc::new(Inner {
            writer: tokio::sync::Mutex::new(wr),
            pending,
            next_id: AtomicU64::new(1),
            alive,
            config,
            hello,
            tasks: Mutex::new(vec![reader]),
        });
        let client = Client { inner };
        if client.inner.config.heartbeat {
            let weak = Arc::downgrade(&client.inner);
            let every =
                Duration::from_millis((client.inner.hello.session_timeout_ms / 3).max(100) as u64);
            let pinger = tokio::spawn(async move {
                let mut tick = tokio::time::interval(every);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    let Some(inner) = weak.upgrade() else { return };
                    let c = Client { inner };
                    if !c.is_connected() {
                        return;
                    }
                    let _ = c.request(Request::Ping(Ping {})).await;
                }
            });
            client.inner.tasks.lock().push(pinger);
        }
        Ok(client)
    }

    /// kvd's hello.
    pub fn server(&self) -> &HelloOk {
        &self.inner.hello
    }

    /// The settings this client was made with.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// False once the connection has broken.
    pub fn is_connected(&self) -> bool {
        self.inner.alive.load(Ordering::SeqCst)
    }

    /// Sends a request and waits for its reply (which may be `Reply::Error`).
    pub async fn request(&self, req: Request) -> Result<Reply, ClientError> {
        let op = req.op_name();
        let (tx, rx) = oneshot::channel();
        let id = self.next_id();
        self.send_raw(
            id,
            encode_request(id, &req),
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        )
        .await;
        self.wait(id, op, rx).await
    }

    /// Sends a raw frame (for tests of malformed input) and waits for the reply to `request_id`.
    pub async fn request_raw(&self, request_id: u64, frame: Bytes) -> Result<Reply, ClientError> {
        let (tx, rx) = oneshot::channel();
        self.send_raw(
            request_id,
            frame,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        )
        .await;
        self.wait(request_id, "raw", rx).await
    }

    async fn wait(
        &self,
        id: u64,
        op: &'static str,
        rx: oneshot::Receiver<Result<Reply, ClientError>>,
    ) -> Result<Reply, ClientError> {
        let after = self.inner.config.request_timeout;
        match tokio::time::timeout(after, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(ClientError::Disconnected("connection task ended".into())),
            Err(_) => {
                self.forget(id);
                Err(ClientError::Timeout { op, after })
            }
        }
    }

    /// A fresh request id.
    pub fn next_id(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends `req` under id `id` from the calling task and returns once it is written;
    /// `on_reply` hears the reply, or why there will be none. The caller owns the timeout:
    /// [`Client::forget`] drops a request that took too long.
    pub async fn send(&self, id: u64, req: &Request, on_reply: OnReply) {
        self.send_raw(id, encode_request(id, req), on_reply).await
    }

    async fn send_raw(&self, id: u64, frame: Bytes, on_reply: OnReply) {
        if !self.is_connected() {
            return on_reply(Err(ClientError::Disconnected(
                "connection already lost".into(),
            )));
        }
        self.inner.pending.lock().insert(id, on_reply);
        let sent = self.inner.writer.lock().await.send(&[frame]).await;
        if let Err(e) = sent {
            // The reply will never come: fail this request and, since the connection is
            // broken, every other one.
            self.inner.alive.store(false, Ordering::SeqCst);
            fail_all(&self.inner.pending, &e.to_string());
        }
    }

    /// Stops waiting for request `id` (timed out); its reply, if it comes, is dropped.
    pub fn forget(&self, id: u64) {
        self.inner.pending.lock().remove(&id);
    }

    /// A fresh random token for [`Client::share_fds_under`].
    pub fn fd_token() -> u128 {
        loop {
            let t = rand::random::<u128>();
            if t != 0 {
                return t;
            }
        }
    }

    /// Shares descriptors over kvd's fd socket under a fresh random token, which a `Register`
    /// then names.
    pub async fn share_fds(&self, fds: Vec<std::os::fd::OwnedFd>) -> Result<u128, ClientError> {
        let token = Self::fd_token();
        self.share_fds_under(token, fds).await?;
        Ok(token)
    }

    /// Shares more descriptors under `token`; kvd numbers them after those sent before. Lets a
    /// client with thousands of descriptors send and close them in batches.
    pub async fn share_fds_under(
        &self,
        token: u128,
        fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<(), ClientError> {
        let path = self
            .inner
            .config
            .fd_socket
            .clone()
            .unwrap_or_else(|| PathBuf::from(&self.inner.hello.fd_socket));
        tokio::task::spawn_blocking(move || {
            let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(std::os::fd::AsFd::as_fd).collect();
            crate::fdpass::send_fds(&path, token, &borrowed)
        })
        .await
        .map_err(|e| ClientError::FdPass(e.to_string()))?
        .map_err(|e| ClientError::FdPass(e.to_string()))?;
        Ok(())
    }
}

fn server_error(e: ErrorReply) -> ClientError {
    ClientError::Server {
        code: e.code,
        message: e.message,
    }
}

macro_rules! typed {
    ($(#[$m:meta])* $name:ident($arg:ty) -> $out:ty : $req:ident => $rep:ident) => {
        $(#[$m])*
        pub async fn $name(&self, arg: $arg) -> Result<$out, ClientError> {
            match self.request(Request::$req(arg)).await? {
                Reply::$rep(r) => Ok(r),
                Reply::Error(e) => Err(server_error(e)),
                other => Err(ClientError::Protocol(format!("{other:?}"))),
            }
        }
    };
}

impl Client {
    typed!(/// Registers a KV cache.
        register(Register) -> Registered : Register => Registered);
    typed!(/// Prefix lookup.
        lookup(Lookup) -> LookupReply : Lookup => Lookup);
    typed!(/// State lookup: the last of the chunks named that is stored.
        lookup_last(Lookup) -> LookupReply : LookupLast => Lookup);
    typed!(/// Stores chunks.
        store(Store) -> StoreReply : Store => Store);
    typed!(/// Retrieves chunks.
        retrieve(Retrieve) -> RetrieveReply : Retrieve => Retrieve);
    typed!(/// Drops a pin.
        release(Release) -> Released : Release => Released);
    typed!(/// Liveness.
        ping(Ping) -> Pong : Ping => Pong);
    typed!(/// Counters.
        stats(StatsRequest) -> Stats : Stats => Stats);
    typed!(/// The removal feed after a sequence number.
        events(Events) -> EventsReply : Events => Events);

    /// Drops a registration.
    pub async fn unregister(&self, region: u32) -> Result<(), ClientError> {
        match self
            .request(Request::Unregister(Unregister { region }))
            .await?
        {
            Reply::Unregistered => Ok(()),
            Reply::Error(e) => Err(server_error(e)),
            other => Err(ClientError::Protocol(format!("{other:?}"))),
        }
    }
}
