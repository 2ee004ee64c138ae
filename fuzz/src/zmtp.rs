//! The ZMTP codec (`kvd_proto::zmtp::codec`) reading a byte stream a peer controls: the
//! greeting and READY handshake, then messages, commands and PINGs, each message handed to the
//! request decoder as kvd's ROUTER does. Reads must keep to [`Limits`], and a stream that ends
//! must end the reader (an in-memory stream never blocks, so a pending read is a hang).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use kvd_proto::wire::{decode_request, frame::HEADER_BYTES};
use kvd_proto::zmtp::codec::handshake;
use kvd_proto::zmtp::{read_message, Inbound, Limits};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Most messages read from one input: an input holds few more.
const MAX_MESSAGES: usize = 4096;

/// A peer's bytes to read; what we send is dropped.
struct Peer<'a>(&'a [u8]);

impl AsyncRead for Peer<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.0.len().min(buf.remaining());
        buf.put_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for Peer<'_> {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
        b: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Ok(b.len()))
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Drives a future over in-memory I/O to its end; it must never wait.
fn run<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = Context::from_waker(std::task::Waker::noop());
    // Tokio's cooperative budget may yield once in a while; a real wait never ends.
    for _ in 0..1_000_000 {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
    }
    panic!("the ZMTP reader waits on a stream that has nothing more to give");
}

/// First byte: bit 7 — handshake as kvd's ROUTER first; bits 0–1 — the frame limit; bits 2–4
/// — the part limit. The rest is the peer's stream.
pub fn stream(data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let limits = Limits {
        max_frame_bytes: [0, 12, 255, 4096][usize::from(mode & 3)],
        max_parts: 1 + usize::from((mode >> 2) & 7),
        handshake_timeout: Duration::from_secs(1),
    };
    let mut peer = Peer(rest);
    run(async {
        if mode & 0x80 != 0 {
            match handshake(&mut peer, true, "ROUTER", b"", &["DEALER", "REQ"]).await {
                Ok(info) => assert!(
                    ["DEALER", "REQ"]
                        .iter()
                        .any(|t| t.eq_ignore_ascii_case(&info.socket_type)),
                    "accepted a {:?} peer",
                    info.socket_type
                ),
                Err(_) => return,
            }
        }
        for _ in 0..MAX_MESSAGES {
            match read_message(&mut peer, &limits).await {
                Ok(Inbound::Message(parts)) => {
                    assert!(!parts.is_empty() && parts.len() <= limits.max_parts);
                    for part in &parts {
                        assert!(part.len() <= limits.max_frame_bytes);
                        let _ = decode_request(part, limits.max_frame_bytes);
                    }
                }
                Ok(Inbound::Oversized { head, .. }) => assert!(head.len() <= HEADER_BYTES),
                Ok(Inbound::Ping(context)) => assert!(context.len() <= 64 * 1024),
                Err(_) => return,
            }
        }
    });
}
