//! Sharing file descriptors with kvd over a Unix socket (SCM_RIGHTS): a client's memfd (host
//! backend) or the descriptors of its CUDA VMM chunks. A client picks a random 128-bit token,
//! sends its descriptors under it, then names the token in a `Register` request over ZMQ; kvd
//! hands the descriptors to that registration and closes what it does not keep.
//!
//! Only the socket path is shared, so this works between containers that share nothing else
//! (no PID namespace, no `pidfd_getfd`).
//!
//! Wire format, per message: `"KVFD"`, version (u16 LE), descriptor count (u16 LE), token
//! (u128 LE), with the descriptors attached (at most 253, the kernel's SCM_MAX_FD). kvd answers
//! each message with a status (u32 LE, 0 = ok) and the descriptors now held under the token.

use std::collections::HashMap;
use std::io::{IoSlice, IoSliceMut, Read};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// Most descriptors in one message (the kernel's SCM_MAX_FD).
pub const MAX_FDS_PER_MESSAGE: usize = 253;
const MAGIC: [u8; 4] = *b"KVFD";
const VERSION: u16 = 1;
const HEADER_BYTES: usize = 24;

/// Status codes of the fd socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
enum Status {
    Ok = 0,
    Malformed = 1,
    StashFull = 2,
    CountMismatch = 3,
}

/// Why descriptors could not be shared.
#[derive(Debug, thiserror::Error)]
pub enum FdPassError {
    /// Socket trouble.
    #[error("fd socket {path}: {source}")]
    Io {
        /// The socket.
        path: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// kvd refused the message.
    #[error("kvd refused the descriptors: {0}")]
    Refused(String),
}

/// Sends `fds` under `token`, in messages of at most 253. Blocking; call it off the async
/// runtime.
pub fn send_fds(path: &Path, token: u128, fds: &[BorrowedFd<'_>]) -> Result<u32, FdPassError> {
    let io = |source| FdPassError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut stream = StdUnixStream::connect(path).map_err(io)?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(io)?;
    let mut held = 0;
    for batch in fds.chunks(MAX_FDS_PER_MESSAGE) {
        let mut header = [0u8; HEADER_BYTES];
        header[..4].copy_from_slice(&MAGIC);
        header[4..6].copy_from_slice(&VERSION.to_le_bytes());
        header[6..8].copy_from_slice(&(batch.len() as u16).to_le_bytes());
        header[8..24].copy_from_slice(&token.to_le_bytes());
        let mut space =
            [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_MESSAGE))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(batch)) {
            return Err(FdPassError::Refused("descriptor batch does not fit".into()));
        }
        let sent = rustix::net::sendmsg(
            &stream,
            &[IoSlice::new(&header)],
            &mut control,
            SendFlags::empty(),
        )
        .map_err(|e| io(e.into()))?;
        if sent != HEADER_BYTES {
            return Err(io(std::io::Error::other("short write of the fd header")));
        }
        let mut reply = [0u8; 8];
        stream.read_exact(&mut reply).map_err(io)?;
        let status = u32::from_le_bytes(reply[..4].try_into().expect("4 bytes"));
        held = u32::from_le_bytes(reply[4..].try_into().expect("4 bytes"));
        match status {
            0 => {}
            2 => return Err(FdPassError::Refused("kvd holds too many unclaimed descriptors; register the ones sent before, or retry later".into())),
            s => return Err(FdPassError::Refused(format!("status {s}"))),
        }
    }
    Ok(held)
}

struct Stashed {
    fds: Vec<OwnedFd>,
    since: Instant,
}

/// Descriptors received and not yet claimed by a registration.
pub struct FdStash {
    inner: Mutex<HashMap<u128, Stashed>>,
    max_fds: usize,
}

impl std::fmt::Debug for FdStash {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FdStash")
            .field("tokens", &self.inner.lock().len())
            .finish()
    }
}

impl FdStash {
    /// A stash that holds at most `max_fds` unclaimed descriptors.
    pub fn new(max_fds: usize) -> Self {
        FdStash {
            inner: Mutex::new(HashMap::new()),
            max_fds,
        }
    }

    fn held(map: &HashMap<u128, Stashed>) -> usize {
        map.values().map(|s| s.fds.len()).sum()
    }

    fn add(&self, token: u128, fds: Vec<OwnedFd>) -> Result<u32, Status> {
        let mut map = self.inner.lock();
        if Self::held(&map) + fds.len() > self.max_fds {
            return Err(Status::StashFull);
        }
        let entry = map.entry(token).or_insert_with(|| Stashed {
            fds: Vec::new(),
            since: Instant::now(),
        });
        entry.fds.extend(fds);
        Ok(entry.fds.len() as u32)
    }

    /// Takes every descriptor sent under `token`.
    pub fn take(&self, token: u128) -> Option<Vec<OwnedFd>> {
        self.inner.lock().remove(&token).map(|s| s.fds)
    }

    /// Closes descriptors unclaimed for longer than `max_age`; returns how many.
    pub fn expire(&self, max_age: Duration) -> usize {
        let mut map = self.inner.lock();
        let before = Self::held(&map);
        map.retain(|_, s| s.since.elapsed() < max_age);
        before - Self::held(&map)
    }
}

/// Binds the fd socket (removing a stale one) with mode 0666: sharing a descriptor grants kvd
/// access to the sender's memory, never the reverse, and tokens are unguessable.
pub async fn bind(path: &Path) -> std::io::Result<UnixListener> {
    crate::zmtp::router::remove_stale_socket(path)
        .await
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::AddrInUse, e.to_string()))?;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let listener = UnixListener::bind(path)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// Accepts fd-sharing connections until `stop`.
pub async fn serve(
    listener: UnixListener,
    stash: Arc<FdStash>,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let stop2 = stop.clone();
    crate::accept::accept_until(
        "fd socket",
        stop,
        tracker,
        || async { listener.accept().await.map(|(s, _)| s) },
        move |stream| {
            let stash = stash.clone();
            let stop = stop2.clone();
            async move {
                tokio::select! {
                    _ = stop.cancelled() => {}
                    r = connection(stream, &stash) => {
                        if let Err(e) = r {
                            tracing::debug!("fd socket connection ended: {e}");
                        }
                    }
                }
            }
        },
    )
    .await
}

async fn connection(mut stream: UnixStream, stash: &FdStash) -> std::io::Result<()> {
    loop {
        let mut header = [0u8; HEADER_BYTES];
        let (bytes, flags, fds) = loop {
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
        let count = u16::from_le_bytes([header[6], header[7]]) as usize;
        let token = u128::from_le_bytes(header[8..24].try_into().expect("16 bytes"));
        let status = if bytes != HEADER_BYTES
            || header[..4] != MAGIC
            || u16::from_le_bytes([header[4], header[5]]) != VERSION
            || token == 0
        {
            Err(Status::Malformed)
        } else if flags.contains(ReturnFlags::CTRUNC) || fds.len() != count {
            Err(Status::CountMismatch)
        } else {
            stash.add(token, fds)
        };
        let (code, held) = match status {
            Ok(held) => (Status::Ok, held),
            Err(s) => (s, 0),
        };
        let mut reply = [0u8; 8];
        reply[..4].copy_from_slice(&(code as u32).to_le_bytes());
        reply[4..].copy_from_slice(&held.to_le_bytes());
        stream.write_all(&reply).await?;
        if code == Status::Malformed {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[tokio::test]
    async fn descriptors_arrive_under_their_token_in_batches() {
        let dir = std::env::temp_dir().join(format!("kvd-fdpass-{}", std::process::id()));
        let path = dir.join("fd.sock");
        let listener = bind(&path).await.unwrap();
        let stash = Arc::new(FdStash::new(10_000));
        let stop = CancellationToken::new();
        let tracker = TaskTracker::new();
        tokio::spawn(serve(
            listener,
            stash.clone(),
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

    #[tokio::test]
    async fn a_full_stash_refuses_and_old_entries_expire() {
        let stash = FdStash::new(2);
        let fd = || rustix::fs::memfd_create("x", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        assert_eq!(stash.add(1, vec![fd(), fd()]), Ok(2));
        assert_eq!(stash.add(2, vec![fd()]), Err(Status::StashFull));
        assert_eq!(stash.expire(Duration::from_secs(60)), 0);
        assert_eq!(stash.expire(Duration::ZERO), 2);
        assert!(stash.take(1).is_none());
    }
}
