//! The fd socket's wire format and its client side: a client picks a random 128-bit token, sends
//! its descriptors (a memfd on the host backend, the chunks of CUDA VMM memory) under it over a
//! Unix socket (SCM_RIGHTS), then names the token in a `Register` request over ZMQ.
//!
//! Only the socket path is shared, so this works between containers that share nothing else
//! (no PID namespace, no `pidfd_getfd`).
//!
//! Per message: `"KVFD"`, version (u16 LE), descriptor count (u16 LE), token (u128 LE), with the
//! descriptors attached (at most 253, the kernel's SCM_MAX_FD). kvd answers each message with a
//! status (u32 LE, [`Status`]) and the descriptors now held under the token (u32 LE).

use std::io::{IoSlice, Read};
use std::mem::MaybeUninit;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream as StdUnixStream;
use std::path::Path;
use std::time::Duration;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};

/// Most descriptors in one message (the kernel's SCM_MAX_FD).
pub const MAX_FDS_PER_MESSAGE: usize = 253;
/// Bytes of a message's header.
pub const HEADER_BYTES: usize = 24;
/// Bytes of kvd's answer to one message.
pub const REPLY_BYTES: usize = 8;
const MAGIC: [u8; 4] = *b"KVFD";
const VERSION: u16 = 1;

/// Status codes of the fd socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    /// Held under the token.
    Ok = 0,
    /// Not a kvd fd-socket header (magic, version, length or a zero token).
    Malformed = 1,
    /// kvd holds as many unclaimed descriptors as it allows.
    StashFull = 2,
    /// The header's count differs from the descriptors that arrived.
    CountMismatch = 3,
}

impl Status {
    fn from_u32(v: u32) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::Malformed,
            2 => Status::StashFull,
            3 => Status::CountMismatch,
            _ => return None,
        })
    }
}

/// A message header: the token and how many descriptors come with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The client's token (never 0).
    pub token: u128,
    /// Descriptors attached.
    pub count: u16,
}

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[6..8].copy_from_slice(&self.count.to_le_bytes());
        h[8..24].copy_from_slice(&self.token.to_le_bytes());
        h
    }

    /// Parses the bytes of one message; `None` for anything that is not a whole, current header
    /// with a non-zero token and at most [`MAX_FDS_PER_MESSAGE`] descriptors.
    pub fn decode(bytes: &[u8]) -> Option<Header> {
        if bytes.len() != HEADER_BYTES
            || bytes[..4] != MAGIC
            || u16::from_le_bytes([bytes[4], bytes[5]]) != VERSION
        {
            return None;
        }
        let count = u16::from_le_bytes([bytes[6], bytes[7]]);
        let token = u128::from_le_bytes(bytes[8..24].try_into().ok()?);
        (token != 0 && count as usize <= MAX_FDS_PER_MESSAGE).then_some(Header { token, count })
    }
}

/// kvd's answer to one message.
pub fn encode_reply(status: Status, held: u32) -> [u8; REPLY_BYTES] {
    let mut reply = [0u8; REPLY_BYTES];
    reply[..4].copy_from_slice(&(status as u32).to_le_bytes());
    reply[4..].copy_from_slice(&held.to_le_bytes());
    reply
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
        let header = Header {
            token,
            count: batch.len() as u16,
        }
        .encode();
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
        let mut reply = [0u8; REPLY_BYTES];
        stream.read_exact(&mut reply).map_err(io)?;
        let status = u32::from_le_bytes(reply[..4].try_into().expect("4 bytes"));
        held = u32::from_le_bytes(reply[4..].try_into().expect("4 bytes"));
        match Status::from_u32(status) {
            Some(Status::Ok) => {}
            Some(Status::StashFull) => return Err(FdPassError::Refused("kvd holds too many unclaimed descriptors; register the ones sent before, or retry later".into())),
            _ => return Err(FdPassError::Refused(format!("status {status}"))),
        }
    }
    Ok(held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_bad_ones_are_refused() {
        let h = Header {
            token: 42,
            count: 7,
        };
        assert_eq!(Header::decode(&h.encode()), Some(h));
        let mut bad = h.encode();
        bad[0] = b'X';
        assert_eq!(Header::decode(&bad), None, "magic");
        let mut bad = h.encode();
        bad[4] = 9;
        assert_eq!(Header::decode(&bad), None, "version");
        assert_eq!(Header::decode(&h.encode()[..23]), None, "short");
        assert_eq!(
            Header::decode(&Header { token: 0, count: 1 }.encode()),
            None,
            "zero token"
        );
        assert_eq!(
            Header::decode(
                &Header {
                    token: 1,
                    count: 254
                }
                .encode()
            ),
            None,
            "more than SCM_MAX_FD"
        );
    }
}
