//! kvd's end of the fd socket (wire format and client side in `kvd_proto::fdpass`): descriptors
//! received under a client's token wait in the [`FdStash`] until a `Register` request claims
//! them, and are closed when they are not claimed in time.
//!
//! Every descriptor a client sends becomes one of kvd's, so what a client may hold here is
//! bounded below kvd's open-file limit (`FdLimits`, sized from it at start): open connections
//! and unclaimed descriptors, in total and per user (`SO_PEERCRED`), and a connection that sends
//! nothing for `idle_timeout` is closed. Who may connect at all is the socket file's mode
//! (`--fd-socket-mode`, 0660 by default: kvd's user and group).

use std::collections::HashMap;
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_proto::fdpass::{encode_reply, Header, Status, HEADER_BYTES, MAX_FDS_PER_MESSAGE};
use parking_lot::Mutex;

use crate::ops::metrics::Metrics;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What the fd socket lets clients hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimits {
    /// Open connections.
    pub max_connections: usize,
    /// Open connections of one user (by `SO_PEERCRED`).
    pub max_connections_per_uid: usize,
    /// Unclaimed descriptors held.
    pub max_stashed: usize,
    /// Unclaimed descriptors sent by one user.
    pub max_stashed_per_uid: usize,
    /// kvd's own user, held only to the totals: it could ptrace kvd anyway, and one vLLM under
    /// it may need every descriptor at once. `None`: every user gets the per-user share.
    pub own_uid: Option<u32>,
    /// A connection silent this long is closed.
    pub idle_timeout: Duration,
}

struct Stashed {
    fds: Vec<OwnedFd>,
    since: Instant,
    uid: u32,
}

#[derive(Default)]
struct StashInner {
    tokens: HashMap<u128, Stashed>,
    held: usize,
    held_by_uid: HashMap<u32, usize>,
}

impl StashInner {
    fn forget(&mut self, s: &Stashed) {
        self.held -= s.fds.len();
        if let Some(n) = self.held_by_uid.get_mut(&s.uid) {
            *n -= s.fds.len();
            if *n == 0 {
                self.held_by_uid.remove(&s.uid);
            }
        }
    }
}

/// Descriptors received and not yet claimed by a registration.
pub struct FdStash {
    inner: Mutex<StashInner>,
    max_fds: usize,
    max_fds_per_uid: usize,
    own_uid: Option<u32>,
}

impl std::fmt::Debug for FdStash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let inner = self.inner.lock();
        f.debug_struct("FdStash")
            .field("tokens", &inner.tokens.len())
            .field("held", &inner.held)
            .finish()
    }
}

impl FdStash {
    /// A stash that holds at most `max_fds` unclaimed descriptors, `max_fds_per_uid` of them
    /// sent by one user other than `own_uid`.
    pub fn new(max_fds: usize, max_fds_per_uid: usize, own_uid: Option<u32>) -> Self {
        FdStash {
            inner: Mutex::new(StashInner::default()),
            max_fds,
            max_fds_per_uid,
            own_uid,
        }
    }

    /// Unclaimed descriptors held.
    pub fn held(&self) -> usize {
        self.inner.lock().held
    }

    fn add(&self, uid: u32, token: u128, fds: Vec<OwnedFd>) -> Result<u32, Status> {
        let mut inner = self.inner.lock();
        let by_uid = inner.held_by_uid.get(&uid).copied().unwrap_or(0);
        let share = if Some(uid) == self.own_uid {
            self.max_fds
        } else {
            self.max_fds_per_uid
        };
        if inner.held + fds.len() > self.max_fds || by_uid + fds.len() > share {
            return Err(Status::StashFull);
        }
        // A token belongs to the user who first sent under it.
        if inner.tokens.get(&token).is_some_and(|s| s.uid != uid) {
            return Err(Status::Malformed);
        }
        let n = fds.len();
        inner.held += n;
        *inner.held_by_uid.entry(uid).or_default() += n;
        let entry = inner.tokens.entry(token).or_insert_with(|| Stashed {
            fds: Vec::new(),
            since: Instant::now(),
            uid,
        });
        entry.fds.extend(fds);
        Ok(entry.fds.len() as u32)
    }

    /// Takes every descriptor sent under `token`.
    pub fn take(&self, token: u128) -> Option<Vec<OwnedFd>> {
        let mut inner = self.inner.lock();
        let s = inner.tokens.remove(&token)?;
        inner.forget(&s);
        Some(s.fds)
    }

    /// Closes descriptors unclaimed for longer than `max_age`; returns how many.
    pub fn expire(&self, max_age: Duration) -> usize {
        let mut inner = self.inner.lock();
        let old: Vec<u128> = inner
            .tokens
            .iter()
            .filter(|(_, s)| s.since.elapsed() >= max_age)
            .map(|(&t, _)| t)
            .collect();
        let mut closed = 0;
        for t in old {
            if let Some(s) = inner.tokens.remove(&t) {
                inner.forget(&s);
                closed += s.fds.len();
            }
        }
        closed
    }
}

/// Binds the fd socket (removing a stale one) with permission bits `mode`. Whoever can connect
/// can make kvd hold descriptors (bounded by [`FdLimits`]); sharing one grants kvd access to the
/// sender's memory, never the reverse, and tokens are unguessable.
pub async fn bind(path: &Path, mode: u32) -> std::io::Result<UnixListener> {
    // The same rules as --ipc: kvd creates no directories (a typo would otherwise become a
    // tree, even under / as root), and a socket someone listens on is not taken over.
    crate::control::router::check_socket_dir(path)?;
    crate::control::router::remove_stale_socket(path)
        .await
        .map_err(|e| match e {
            crate::zmtp::ZmtpError::Io { source, .. } => source,
            other => std::io::Error::other(other.to_string()),
        })?;
    let listener = UnixListener::bind(path)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    Ok(listener)
}

/// Open connections, in total and per user.
#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_uid: HashMap<u32, usize>,
}

/// One admitted connection; gives its place back on drop.
struct Admitted {
    uid: u32,
    open: Arc<Mutex<Open>>,
    metrics: Metrics,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut o = self.open.lock();
        o.total -= 1;
        if let Some(n) = o.by_uid.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                o.by_uid.remove(&self.uid);
            }
        }
        self.metrics.fd_socket_connections.set(o.total as i64);
    }
}

fn admit(
    stream: &UnixStream,
    open: &Arc<Mutex<Open>>,
    limits: &FdLimits,
    metrics: &Metrics,
) -> Result<Admitted, &'static str> {
    // A peer whose credentials cannot be read counts as one anonymous user.
    let uid = rustix::net::sockopt::socket_peercred(stream)
        .map(|c| c.uid.as_raw())
        .unwrap_or(u32::MAX);
    let mut o = open.lock();
    if o.total >= limits.max_connections {
        return Err("connections");
    }
    let mine = o.by_uid.get(&uid).copied().unwrap_or(0);
    if Some(uid) != limits.own_uid && mine >= limits.max_connections_per_uid {
        return Err("peer_connections");
    }
    o.total += 1;
    *o.by_uid.entry(uid).or_default() += 1;
    metrics.fd_socket_connections.set(o.total as i64);
    Ok(Admitted {
        uid,
        open: open.clone(),
        metrics: metrics.clone(),
    })
}

/// Accepts fd-sharing connections until `stop`.
pub async fn serve(
    listener: UnixListener,
    stash: Arc<FdStash>,
    limits: FdLimits,
    metrics: Metrics,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let stop2 = stop.clone();
    let open: Arc<Mutex<Open>> = Arc::default();
    crate::ops::accept::accept_until(
        "fd socket",
        stop,
        tracker,
        || async { listener.accept().await.map(|(s, _)| s) },
        move |stream| {
            let stash = stash.clone();
            let stop = stop2.clone();
            let admitted = admit(&stream, &open, &limits, &metrics);
            let metrics = metrics.clone();
            async move {
                let admitted = match admitted {
                    Ok(a) => a,
                    Err(reason) => {
                        metrics
                            .fd_socket_refusals
                            .with_label_values(&[reason])
                            .inc();
                        tracing::warn!(
                            "fd socket: refusing a connection ({reason} at the limit: {} in all, {} per user; --fd-max-connections)",
                            limits.max_connections,
                            limits.max_connections_per_uid
                        );
                        return;
                    }
                };
                tokio::select! {
                    _ = stop.cancelled() => {}
                    r = connection(stream, &stash, admitted.uid, &limits, &metrics) => {
                        if let Err(e) = r {
                            tracing::debug!("fd socket connection ended: {e}");
                        }
                    }
                }
                drop(admitted);
            }
        },
    )
    .await
}

async fn connection(
    mut stream: UnixStream,
    stash: &FdStash,
    uid: u32,
    limits: &FdLimits,
    metrics: &Metrics,
) -> std::io::Result<()> {
    loop {
        let mut header = [0u8; HEADER_BYTES];
        let (bytes, flags, fds) = loop {
            if tokio::time::timeout(limits.idle_timeout, stream.readable())
                .await
                .is_err()
            {
                metrics
                    .fd_socket_refusals
                    .with_label_values(&["idle"])
                    .inc();
                return Ok(());
            }
            stream.readable().await?;
            let r = stream.try_io(Interest::READABLE, || {
                let mut space =
                    [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_MESSAGE))];
                let mut control = RecvAncillaryBuffer::new(&mut space);
                let msg = rustix::net::recvmsg(
                    &stream,
                    &mut [IoSliceMut::new(&mut header)],
                    &mut control,
                    RecvFlags::CMSG_CLOEXEC,
                )?;
                let mut fds = Vec::new();
                for m in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(rights) = m {
                        fds.extend(rights);
                    }
                }
                Ok((msg.bytes, msg.flags, fds))
            });
            match r {
                Ok(v) => break v,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
        };
        if bytes == 0 {
            return Ok(());
        }
        let status = match Header::decode(&header[..bytes]) {
            None => Err(Status::Malformed),
            Some(h) if flags.contains(ReturnFlags::CTRUNC) || fds.len() != h.count as usize => {
                Err(Status::CountMismatch)
            }
            Some(h) => stash.add(uid, h.token, fds),
        };
        if status == Err(Status::StashFull) {
            metrics
                .fd_socket_refusals
                .with_label_values(&["stash_full"])
                .inc();
            tracing::warn!(
                uid,
                "fd socket: refusing descriptors, {} unclaimed already held ({} per user; --fd-max-stashed)",
                stash.held(),
                stash.max_fds_per_uid
            );
        }
        metrics.fd_stashed.set(stash.held() as i64);
        let (code, held) = match status {
            Ok(held) => (Status::Ok, held),
            Err(s) => (s, 0),
        };
        stream.write_all(&encode_reply(code, held)).await?;
        if code == Status::Malformed {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvd_proto::fdpass::send_fds;
    use std::os::fd::{AsFd, BorrowedFd};

    #[tokio::test]
    async fn a_socket_in_a_missing_directory_is_refused_and_no_directory_made() {
        let dir = std::env::temp_dir().join(format!("kvd-fdnodir-{}", std::process::id()));
        let path = dir.join("sub").join("fd.sock");
        let err = bind(&path, 0o600).await.unwrap_err();
        assert!(err.to_string().contains("does not exist"), "{err}");
        assert!(!dir.exists());
    }

    #[tokio::test]
    async fn descriptors_arrive_under_their_token_in_batches() {
        let dir = std::env::temp_dir().join(format!("kvd-fdpass-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fd.sock");
        let listener = bind(&path, 0o600).await.unwrap();
        let stash = Arc::new(FdStash::new(10_000, 10_000, None));
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        tokio::spawn(serve(
            listener,
            stash.clone(),
            test_limits(),
            Metrics::new(),
            stop.clone(),
            tracker.clone(),
        ));

        let files: Vec<OwnedFd> = (0..300)
            .map(|i| {
                rustix::fs::memfd_create(format!("t{i}"), rustix::fs::MemfdFlags::CLOEXEC).unwrap()
            })
            .collect();
        for (i, f) in files.iter().enumerate() {
            rustix::fs::ftruncate(f, i as u64 + 1).unwrap();
        }
        let p = path.clone();
        let (held, files) = tokio::task::spawn_blocking(move || {
            let borrowed: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
            (send_fds(&p, 42, &borrowed), files)
        })
        .await
        .unwrap();
        let held = held.unwrap();
        drop(files);
        assert_eq!(held, 300);
        let got = stash.take(42).unwrap();
        assert_eq!(got.len(), 300);
        // Same files, in order: sizes 1..=300.
        for (i, f) in got.iter().enumerate() {
            assert_eq!(rustix::fs::fstat(f).unwrap().st_size, i as i64 + 1);
        }
        assert!(stash.take(42).is_none());
        stop.cancel();
        std::fs::remove_dir_all(dir).ok();
    }

    fn test_limits() -> FdLimits {
        FdLimits {
            max_connections: 8,
            max_connections_per_uid: 4,
            max_stashed: 10_000,
            max_stashed_per_uid: 10_000,
            idle_timeout: Duration::from_secs(10),
            own_uid: None,
        }
    }

    #[tokio::test]
    async fn a_full_stash_refuses_and_old_entries_expire() {
        let stash = FdStash::new(3, 2, None);
        let fd = || rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        assert_eq!(stash.add(7, 1, vec![fd(), fd()]), Ok(2));
        // User 7 has its half; user 8 gets the rest, and no more.
        assert_eq!(stash.add(7, 2, vec![fd()]), Err(Status::StashFull));
        assert_eq!(stash.add(8, 2, vec![fd()]), Ok(1));
        assert_eq!(stash.add(9, 3, vec![fd()]), Err(Status::StashFull));
        // Another user cannot add to a token it did not open.
        assert_eq!(stash.take(2).map(|f| f.len()), Some(1));
        assert_eq!(stash.add(8, 1, vec![fd()]), Err(Status::Malformed));
        assert_eq!(stash.held(), 2);
        assert_eq!(stash.expire(Duration::from_secs(60)), 0);
        assert_eq!(stash.expire(Duration::ZERO), 2);
        assert_eq!(stash.held(), 0);
        assert!(stash.take(1).is_none());
        assert_eq!(stash.add(7, 1, vec![fd(), fd()]), Ok(2), "room again");
        // kvd's own user is held to the total only.
        let own = FdStash::new(3, 1, Some(7));
        assert_eq!(own.add(7, 1, vec![fd(), fd(), fd()]), Ok(3));
        assert_eq!(own.add(8, 2, vec![fd()]), Err(Status::StashFull));
    }

    #[tokio::test]
    async fn connections_are_capped_per_user_and_idle_ones_closed() {
        use std::io::Read;
        let dir = std::env::temp_dir().join(format!("kvd-fdcap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("fd.sock");
        let listener = bind(&path, 0o600).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(mode.permissions().mode() & 0o777, 0o600);
        let stop = CancellationToken::new();
        let metrics = Metrics::new();
        let limits = FdLimits {
            idle_timeout: Duration::from_millis(300),
            ..test_limits()
        };
        tokio::spawn(serve(
            listener,
            Arc::new(FdStash::new(10, 10, None)),
            limits,
            metrics.clone(),
            stop.clone(),
            TaskTracker::new(),
        ));
        let p = path.clone();
        let closed_at_once = tokio::task::spawn_blocking(move || {
            // Every connection here is one user's: four are let in, the rest closed at once.
            let conns: Vec<std::os::unix::net::UnixStream> = (0..6)
                .map(|_| std::os::unix::net::UnixStream::connect(&p).unwrap())
                .collect();
            // Shortly after: the refused ones are at end of file, the others still open.
            std::thread::sleep(Duration::from_millis(100));
            let mut closed = 0;
            for c in &conns {
                c.set_nonblocking(true).unwrap();
                let mut b = [0u8; 1];
                if matches!((&*c).read(&mut b), Ok(0)) {
                    closed += 1;
                }
            }
            // Later every one is closed: the others for idling.
            for mut c in conns {
                c.set_nonblocking(false).unwrap();
                c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
                let mut b = [0u8; 1];
                assert_eq!(c.read(&mut b).unwrap(), 0, "kvd sends nothing unasked");
            }
            closed
        })
        .await
        .unwrap();
        assert_eq!(closed_at_once, 2, "two over the per-user cap");
        let refused = |r: &str| metrics.fd_socket_refusals.with_label_values(&[r]).get();
        assert_eq!(refused("peer_connections"), 2);
        assert_eq!(refused("idle"), 4, "the others were closed for idling");
        for _ in 0..100 {
            if metrics.fd_socket_connections.get() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(metrics.fd_socket_connections.get(), 0);
        stop.cancel();
        std::fs::remove_dir_all(dir).ok();
    }
}
