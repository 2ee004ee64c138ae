//! kvd's end of the fd socket (wire format and client side in `kvd_proto::fdpass`): descriptors
//! received under a client's token wait in the [`FdStash`] until a `Register` request claims
//! them, and are closed when they are not claimed in time.

use std::collections::HashMap;
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_proto::fdpass::{encode_reply, Header, Status, HEADER_BYTES, MAX_FDS_PER_MESSAGE};
use parking_lot::Mutex;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
use tokio::io::{AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

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
    crate::router::remove_stale_socket(path)
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
        let status = match Header::decode(&header[..bytes]) {
            None => Err(Status::Malformed),
            Some(h) if flags.contains(ReturnFlags::CTRUNC) || fds.len() != h.count as usize => {
                Err(Status::CountMismatch)
            }
            Some(h) => stash.add(h.token, fds),
        };
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
