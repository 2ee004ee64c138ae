//! ZMTP 3.1 (the ZeroMQ wire protocol, rfc.zeromq.org/spec/37) with the NULL mechanism: the
//! framing and handshake both ends share and the DEALER side; kvd's ROUTER (in `kvd-server`) and DEALER clients that interoperate with libzmq, pyzmq and the `zeromq`
//! crate.
//!
//! kvd speaks ZMTP itself rather than through the `zeromq` crate because that crate (0.7.0)
//! reserves a frame's declared length before reading it: one unauthenticated peer that sends a
//! greeting and a frame header declaring 1 TiB aborts the whole process (measured while
//! designing kvd; its codec reserves `waiting_for` bytes up front). Here every length is checked
//! against [`Limits`] first, bodies grow only as bytes arrive, an oversized message is skipped
//! and reported so that the client gets an error reply, handshakes time out, and a
//! disconnect is seen the moment the connection ends.

pub mod codec;
pub mod dealer;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

pub use codec::{read_message, read_message_within, write_message, Budget, Inbound, Oversize};

/// Limits on what a peer may send.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest message part accepted; larger ones are skipped and reported.
    pub max_frame_bytes: usize,
    /// Most parts in one message.
    pub max_parts: usize,
    /// Time a new connection has to complete its greeting and READY.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_frame_bytes: crate::wire::DEFAULT_MAX_FRAME_BYTES,
            max_parts: 8,
            handshake_timeout: Duration::from_secs(5),
        }
    }
}

/// Where a ZMTP socket binds or connects.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `tcp://host:port`.
    Tcp {
        /// Host name or address.
        host: String,
        /// Port; 0 binds any free port.
        port: u16,
    },
    /// `ipc:///path/to/socket`.
    Ipc(PathBuf),
}

impl Endpoint {
    /// Parses `tcp://host:port` or `ipc://path`.
    pub fn parse(s: &str) -> Result<Self, ZmtpError> {
        if let Some(rest) = s.strip_prefix("tcp://") {
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| ZmtpError::Endpoint(format!("{s}: expected tcp://HOST:PORT")))?;
            let port = port
                .parse()
                .map_err(|_| ZmtpError::Endpoint(format!("{s}: bad port {port:?}")))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if host.is_empty() {
                return Err(ZmtpError::Endpoint(format!("{s}: empty host")));
            }
            let host = if host == "*" { "0.0.0.0" } else { host };
            Ok(Endpoint::Tcp {
                host: host.to_string(),
                port,
            })
        } else if let Some(path) = s.strip_prefix("ipc://") {
            if path.is_empty() {
                return Err(ZmtpError::Endpoint(format!("{s}: empty ipc path")));
            }
            Ok(Endpoint::Ipc(PathBuf::from(path)))
        } else {
            Err(ZmtpError::Endpoint(format!(
                "{s}: expected tcp://HOST:PORT or ipc:///PATH"
            )))
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp { host, port } if host.contains(':') => {
                write!(f, "tcp://[{host}]:{port}")
            }
            Endpoint::Tcp { host, port } => write!(f, "tcp://{host}:{port}"),
            Endpoint::Ipc(p) => write!(f, "ipc://{}", p.display()),
        }
    }
}

/// ZMTP failures.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// Socket I/O failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The peer broke the protocol.
    #[error("ZMTP protocol error: {0}")]
    Protocol(String),
    /// The peer's first bytes are not a ZMTP greeting: something other than a ZeroMQ socket
    /// (an HTTP client, a port scanner, TLS) is talking to this port. Holds those bytes.
    #[error("not a ZMTP peer: it sent \"{}\" where a ZMTP greeting begins", .0.escape_ascii())]
    NotZmtp(Vec<u8>),
    /// The peer did not finish its handshake in time.
    #[error("ZMTP handshake did not finish within {0:?}")]
    HandshakeTimeout(Duration),
    /// The connection ended.
    #[error("connection closed")]
    Closed,
    /// A malformed endpoint string.
    #[error("bad endpoint {0}")]
    Endpoint(String),
}

impl ZmtpError {
    /// An I/O error with what was being done; end of file reads as [`ZmtpError::Closed`].
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::UnexpectedEof {
            return ZmtpError::Closed;
        }
        ZmtpError::Io {
            context: context.into(),
            source,
        }
    }
}

/// What the peer said about itself in its READY command.
#[derive(Debug, Clone, Default)]
pub struct PeerInfo {
    /// `Socket-Type` property, e.g. `DEALER`.
    pub socket_type: String,
    /// `Identity` property (may be empty).
    pub identity: Vec<u8>,
    /// Minor ZMTP version the peer speaks (0 or 1).
    pub minor_version: u8,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse_and_print() {
        let e = Endpoint::parse("tcp://127.0.0.1:5555").unwrap();
        assert_eq!(
            e,
            Endpoint::Tcp {
                host: "127.0.0.1".into(),
                port: 5555
            }
        );
        assert_eq!(e.to_string(), "tcp://127.0.0.1:5555");
        assert_eq!(
            Endpoint::parse("tcp://[::1]:1").unwrap().to_string(),
            "tcp://[::1]:1"
        );
        assert_eq!(
            Endpoint::parse("tcp://*:9").unwrap(),
            Endpoint::Tcp {
                host: "0.0.0.0".into(),
                port: 9
            }
        );
        assert_eq!(
            Endpoint::parse("ipc:///tmp/kvd.sock").unwrap(),
            Endpoint::Ipc("/tmp/kvd.sock".into())
        );
        for bad in ["tcp://host", "tcp://:1", "tcp://h:x", "udp://h:1", "ipc://"] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }
}
