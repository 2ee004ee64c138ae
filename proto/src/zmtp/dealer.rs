//! A ZMTP DEALER connection for clients: connect over tcp:// or ipc://, handshake, then send
//! and receive whole messages on separate halves. Reconnecting is the caller's business (the
//! kvd client does it with backoff), so a dead server is an error, never a silent drop.

use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, BufWriter, ReadHalf, WriteHalf};
use tokio::net::{TcpStream, UnixStream};

use super::codec::{handshake, read_message, write_message, Inbound};
use super::{Endpoint, Limits, PeerInfo, ZmtpError};

trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

type BoxStream = Box<dyn Stream>;

/// Receiving half.
pub struct DealerReader {
    rd: ReadHalf<BoxStream>,
    limits: Limits,
}

/// Sending half.
pub struct DealerWriter {
    wr: BufWriter<WriteHalf<BoxStream>>,
}

impl std::fmt::Debug for DealerReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DealerReader")
    }
}

impl std::fmt::Debug for DealerWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DealerWriter")
    }
}

/// Connects, handshakes as a DEALER with `identity`, and splits the connection. Fails after
/// `timeout` rather than retrying in the background.
pub async fn connect(
    endpoint: &Endpoint,
    identity: &[u8],
    limits: Limits,
    timeout: Duration,
) -> Result<(DealerReader, DealerWriter, PeerInfo), ZmtpError> {
    let fut = async {
        let mut stream: BoxStream = match endpoint {
            Endpoint::Tcp { host, port } => {
                let s = TcpStream::connect((host.as_str(), *port))
                    .await
                    .map_err(|e| ZmtpError::io(format!("connecting to {endpoint}"), e))?;
                s.set_nodelay(true)
                    .map_err(|e| ZmtpError::io("setting TCP_NODELAY", e))?;
                Box::new(s)
            }
            Endpoint::Ipc(path) => Box::new(
                UnixStream::connect(path)
                    .await
                    .map_err(|e| ZmtpError::io(format!("connecting to {endpoint}"), e))?,
            ),
        };
        let info = handshake(
            &mut stream,
            false,
            "DEALER",
            identity,
            &["ROUTER", "DEALER"],
        )
        .await?;
        Ok::<_, ZmtpError>((stream, info))
    };
    let (stream, info) = tokio::time::timeout(timeout, fut)
        .await
        .map_err(|_| ZmtpError::HandshakeTimeout(timeout))??;
    let (rd, wr) = tokio::io::split(stream);
    Ok((
        DealerReader { rd, limits },
        DealerWriter {
            wr: BufWriter::with_capacity(64 * 1024, wr),
        },
        info,
    ))
}

impl DealerReader {
    /// Receives the next message. Oversized replies are a protocol error here: kvd never
    /// sends one, so something is wrong with the connection.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        loop {
            match read_message(&mut self.rd, &self.limits).await? {
                Inbound::Message(parts) => return Ok(parts),
                Inbound::Oversized { len, .. } => {
                    return Err(ZmtpError::Protocol(format!(
                        "server sent a {len}-byte frame, above the client's limit"
                    )))
                }
                // A server with ZMTP heartbeats on; kvd's own liveness is the Ping request.
                Inbound::Ping(_) => continue,
            }
        }
    }
}

impl DealerWriter {
    /// Writes one message and flushes it.
    pub async fn send(&mut self, parts: &[Bytes]) -> Result<(), ZmtpError> {
        write_message(&mut self.wr, parts)
            .await
            .map_err(|e| ZmtpError::io("sending", e))?;
        self.wr
            .flush()
            .await
            .map_err(|e| ZmtpError::io("sending", e))
    }

    /// Writes several messages and flushes once.
    pub async fn send_many(&mut self, messages: &[Vec<Bytes>]) -> Result<(), ZmtpError> {
        for parts in messages {
            write_message(&mut self.wr, parts)
                .await
                .map_err(|e| ZmtpError::io("sending", e))?;
        }
        self.wr
            .flush()
            .await
            .map_err(|e| ZmtpError::io("sending", e))
    }
}
