//! ZMTP framing: the 64-byte greeting, the READY handshake, message frames and the PING/PONG
//! commands. Reads are bounded by [`Limits`]; nothing is reserved from a declared length.

use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{Limits, PeerInfo, ZmtpError};

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
/// Bytes of a ZMTP 3 greeting.
pub const GREETING_BYTES: usize = 64;
/// Commands are small; a peer sending a larger one is broken.
const MAX_COMMAND_BYTES: usize = 64 * 1024;
/// Bytes of an oversized frame kept for the error reply (kvd's frame header).
const OVERSIZE_HEAD_BYTES: usize = crate::wire::frame::HEADER_BYTES;

/// A ZMTP 3.1 greeting: signature, version 3.1, mechanism NULL, the as-server flag, filler.
/// Ours; and the one tests and fuzz seeds send when they speak ZMTP by hand.
pub fn greeting(as_server: bool) -> [u8; GREETING_BYTES] {
    let mut g = [0u8; GREETING_BYTES];
    g[0] = 0xFF;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g[32] = u8::from(as_server);
    g
}

fn command(name: &str, body: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(1 + name.len() + body.len());
    out.put_u8(name.len() as u8);
    out.put_slice(name.as_bytes());
    out.put_slice(body);
    out.freeze()
}

fn ready_body(socket_type: &str, identity: &[u8]) -> Bytes {
    let mut props = BytesMut::new();
    for (name, value) in [
        ("Socket-Type", socket_type.as_bytes()),
        ("Identity", identity),
    ] {
        props.put_u8(name.len() as u8);
        props.put_slice(name.as_bytes());
        props.put_u32(value.len() as u32);
        props.put_slice(value);
    }
    command("READY", &props)
}

async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    flags: u8,
    body: &[u8],
) -> std::io::Result<()> {
    let mut head = [0u8; 9];
    let head_len = if body.len() > 255 {
        head[0] = flags | FLAG_LONG;
        head[1..9].copy_from_slice(&(body.len() as u64).to_be_bytes());
        9
    } else {
        head[0] = flags;
        head[1] = body.len() as u8;
        2
    };
    w.write_all(&head[..head_len]).await?;
    w.write_all(body).await
}

/// Writes one message (not flushed).
pub async fn write_message<W: AsyncWrite + Unpin>(
    w: &mut W,
    parts: &[Bytes],
) -> std::io::Result<()> {
    for (i, part) in parts.iter().enumerate() {
        let more = if i + 1 < parts.len() { FLAG_MORE } else { 0 };
        write_frame(w, more, part).await?;
    }
    Ok(())
}

async fn read_frame_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<(u8, u64), ZmtpError> {
    let flags = r
        .read_u8()
        .await
        .map_err(|e| ZmtpError::io("reading a frame", e))?;
    read_frame_length(r, flags).await
}

async fn read_frame_length<R: AsyncRead + Unpin>(
    r: &mut R,
    flags: u8,
) -> Result<(u8, u64), ZmtpError> {
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ZmtpError::Protocol(format!(
            "reserved frame flag bits set: {flags:#04x}"
        )));
    }
    let len = if flags & FLAG_LONG != 0 {
        r.read_u64()
            .await
            .map_err(|e| ZmtpError::io("reading a frame length", e))?
    } else {
        u64::from(
            r.read_u8()
                .await
                .map_err(|e| ZmtpError::io("reading a frame length", e))?,
        )
    };
    Ok((flags, len))
}

/// Reads exactly `len` bytes, growing the buffer only as they arrive.
async fn read_body<R: AsyncRead + Unpin>(r: &mut R, len: u64) -> Result<Bytes, ZmtpError> {
    let mut buf = Vec::with_capacity(len.min(64 * 1024) as usize);
    let got = (&mut *r)
        .take(len)
        .read_to_end(&mut buf)
        .await
        .map_err(|e| ZmtpError::io("reading a frame body", e))?;
    if (got as u64) < len {
        return Err(ZmtpError::Closed);
    }
    Ok(Bytes::from(buf))
}

async fn skip<R: AsyncRead + Unpin>(r: &mut R, len: u64) -> Result<(), ZmtpError> {
    let skipped = tokio::io::copy(&mut (&mut *r).take(len), &mut tokio::io::sink())
        .await
        .map_err(|e| ZmtpError::io("skipping an oversized frame", e))?;
    if skipped < len {
        return Err(ZmtpError::Closed);
    }
    Ok(())
}

fn parse_command(body: &[u8]) -> Result<(&str, &[u8]), ZmtpError> {
    let name_len = *body
        .first()
        .ok_or_else(|| ZmtpError::Protocol("empty command".into()))? as usize;
    let name = body
        .get(1..1 + name_len)
        .and_then(|n| std::str::from_utf8(n).ok())
        .ok_or_else(|| ZmtpError::Protocol("bad command name".into()))?;
    Ok((name, &body[1 + name_len..]))
}

fn parse_properties(mut props: &[u8]) -> Result<PeerInfo, ZmtpError> {
    let bad = || ZmtpError::Protocol("malformed READY metadata".into());
    let mut info = PeerInfo::default();
    while !props.is_empty() {
        let name_len = props[0] as usize;
        let name = props.get(1..1 + name_len).ok_or_else(bad)?;
        let at = 1 + name_len;
        let len_bytes: [u8; 4] = props
            .get(at..at + 4)
            .ok_or_else(bad)?
            .try_into()
            .map_err(|_| bad())?;
        let value_len = u32::from_be_bytes(len_bytes) as usize;
        let value = props.get(at + 4..at + 4 + value_len).ok_or_else(bad)?;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            info.socket_type = String::from_utf8_lossy(value).into_owned();
        } else if name.eq_ignore_ascii_case(b"Identity") {
            info.identity = value.to_vec();
        }
        props = &props[at + 4 + value_len..];
    }
    Ok(info)
}

/// Exchanges greetings and READY commands. Our greeting goes out first and whole, since
/// libzmq sends only its signature and waits for ours before sending the rest.
pub async fn handshake<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    as_server: bool,
    socket_type: &str,
    identity: &[u8],
    accept_peer: &[&str],
) -> Result<PeerInfo, ZmtpError> {
    s.write_all(&greeting(as_server))
        .await
        .map_err(|e| ZmtpError::io("sending the ZMTP greeting", e))?;
    s.flush()
        .await
        .map_err(|e| ZmtpError::io("sending the ZMTP greeting", e))?;
    let mut peer = [0u8; GREETING_BYTES];
    s.read_exact(&mut peer[..11])
        .await
        .map_err(|e| ZmtpError::io("reading the ZMTP greeting", e))?;
    if peer[0] != 0xFF || peer[9] != 0x7F {
        return Err(ZmtpError::NotZmtp(peer[..11].to_vec()));
    }
    if peer[10] < 3 {
        return Err(ZmtpError::Protocol(format!(
            "peer speaks ZMTP {}.x; kvd needs 3.0 or later (libzmq >= 4)",
            peer[10]
        )));
    }
    s.read_exact(&mut peer[11..])
        .await
        .map_err(|e| ZmtpError::io("reading the ZMTP greeting", e))?;
    let mechanism = &peer[12..32];
    let mech_end = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..mech_end] != b"NULL" {
        return Err(ZmtpError::Protocol(format!(
            "peer asks for security mechanism {:?}; kvd speaks only NULL",
            String::from_utf8_lossy(&mechanism[..mech_end])
        )));
    }
    let minor_version = if peer[10] == 3 { peer[11] } else { 1 };

    write_frame(s, FLAG_COMMAND, &ready_body(socket_type, identity))
        .await
        .map_err(|e| ZmtpError::io("sending READY", e))?;
    s.flush()
        .await
        .map_err(|e| ZmtpError::io("sending READY", e))?;

    let (flags, len) = read_frame_header(s).await?;
    if flags & FLAG_COMMAND == 0 || len as usize > MAX_COMMAND_BYTES {
        return Err(ZmtpError::Protocol("expected a READY command".into()));
    }
    let body = read_body(s, len).await?;
    let (name, props) = parse_command(&body)?;
    if name == "ERROR" {
        return Err(ZmtpError::Protocol(format!(
            "peer refused the connection: {}",
            String::from_utf8_lossy(props.get(1..).unwrap_or_default())
        )));
    }
    if name != "READY" {
        return Err(ZmtpError::Protocol(format!("expected READY, got {name}")));
    }
    let mut info = parse_properties(props)?;
    info.minor_version = minor_version;
    if !accept_peer
        .iter()
        .any(|t| t.eq_ignore_ascii_case(&info.socket_type))
    {
        let reason = format!(
            "a {socket_type} socket cannot talk to a {} socket; use one of {accept_peer:?}",
            info.socket_type
        );
        let mut err = BytesMut::new();
        err.put_u8(reason.len().min(255) as u8);
        err.put_slice(&reason.as_bytes()[..reason.len().min(255)]);
        let _ = write_frame(s, FLAG_COMMAND, &command("ERROR", &err)).await;
        let _ = s.flush().await;
        return Err(ZmtpError::Protocol(reason));
    }
    Ok(info)
}

/// What a peer sent.
#[derive(Debug)]
pub enum Inbound {
    /// A whole message.
    Message(Vec<Bytes>),
    /// A message refused by a limit; its bytes were skipped, never buffered. `head` holds the
    /// first bytes of its first part, so the reply can echo its request id.
    Oversized {
        /// Leading bytes of the first part.
        head: Bytes,
        /// Size of the largest part (of the whole message for [`Oversize::Message`] and
        /// [`Oversize::Budget`]).
        len: u64,
        /// Which limit refused it.
        reason: Oversize,
    },
    /// A PING command; reply with [`pong`].
    Ping(Bytes),
}

/// Which limit refused a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Oversize {
    /// A part above `max_frame_bytes`.
    Frame,
    /// More than `max_parts` parts; the count.
    Parts(usize),
    /// Parts that add up to more than `max_frame_bytes`.
    Message,
    /// The reader's shared buffer budget was spent (other connections' unfinished messages).
    Budget,
}

/// Bytes of unfinished and undelivered messages, shared by every connection of a server, so
/// that many connections each sending a partial message cannot grow its memory without bound.
pub type Budget = Arc<Semaphore>;

/// Parts up to this size are not charged to the [`Budget`], so control requests (hello, ping,
/// release) still get through while large ones have spent it; what they can hold is bounded by
/// the connection and in-flight limits instead.
pub const UNBUDGETED_PART_BYTES: u64 = 4096;

/// Budget held by one delivered message; released when dropped.
pub type BudgetPermits = Vec<OwnedSemaphorePermit>;

/// Reads the next message or command. Commands other than PING are ignored.
pub async fn read_message<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
) -> Result<Inbound, ZmtpError> {
    let flags = r
        .read_u8()
        .await
        .map_err(|e| ZmtpError::io("reading a frame", e))?;
    read_rest(r, limits, flags, None).await.map(|(m, _)| m)
}

/// Like [`read_message`], for a server: each part's bytes are taken from `budget` before they
/// are read (a message that finds the budget spent is skipped and reported as
/// [`Oversize::Budget`]), and once a message has begun it must end within `finish_within`,
/// so a peer cannot hold budget by sending half a message and stalling. The permits come back
/// with the message; drop them once its bytes are no longer held.
pub async fn read_message_within<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
    budget: &Budget,
    finish_within: Duration,
) -> Result<(Inbound, BudgetPermits), ZmtpError> {
    let flags = r
        .read_u8()
        .await
        .map_err(|e| ZmtpError::io("reading a frame", e))?;
    tokio::time::timeout(finish_within, read_rest(r, limits, flags, Some(budget)))
        .await
        .map_err(|_| {
            ZmtpError::Protocol(format!(
                "a message did not arrive whole within {finish_within:?}"
            ))
        })?
}

async fn read_rest<R: AsyncRead + Unpin>(
    r: &mut R,
    limits: &Limits,
    first_flags: u8,
    budget: Option<&Budget>,
) -> Result<(Inbound, BudgetPermits), ZmtpError> {
    let mut parts = Vec::new();
    let mut permits = Vec::new();
    let mut oversized: Option<(Bytes, u64, Oversize)> = None;
    let mut total: u64 = 0;
    let mut count: usize = 0;
    let mut first = Some(first_flags);
    loop {
        let (flags, len) = match first.take() {
            Some(f) => read_frame_length(r, f).await?,
            None => read_frame_header(r).await?,
        };
        if flags & FLAG_COMMAND != 0 {
            if !parts.is_empty() || oversized.is_some() {
                return Err(ZmtpError::Protocol(
                    "command inside a multipart message".into(),
                ));
            }
            if len as usize > MAX_COMMAND_BYTES {
                return Err(ZmtpError::Protocol(format!("command of {len} bytes")));
            }
            let body = read_body(r, len).await?;
            let (name, rest) = parse_command(&body)?;
            match name {
                // PING: TTL (2 bytes) then up to 16 bytes of context to echo.
                "PING" => {
                    return Ok((
                        Inbound::Ping(Bytes::copy_from_slice(rest.get(2..).unwrap_or_default())),
                        permits,
                    ))
                }
                _ => continue,
            }
        }
        let more = flags & FLAG_MORE != 0;
        count += 1;
        total = total.saturating_add(len);
        let refusal = if oversized.is_some() {
            None
        } else if len > limits.max_frame_bytes as u64 {
            Some((len, Oversize::Frame))
        } else if count > limits.max_parts {
            Some((len, Oversize::Parts(count)))
        } else if total > limits.max_frame_bytes as u64 {
            Some((total, Oversize::Message))
        } else {
            let charged = budget.filter(|_| len > UNBUDGETED_PART_BYTES);
            match charged.map(|b| b.clone().try_acquire_many_owned(len as u32)) {
                Some(Err(_)) => Some((total, Oversize::Budget)),
                Some(Ok(p)) => {
                    permits.push(p);
                    None
                }
                None => None,
            }
        };
        if let Some((size, reason)) = refusal {
            let head = if parts.is_empty() {
                let keep = len.min(OVERSIZE_HEAD_BYTES as u64);
                let head = read_body(r, keep).await?;
                skip(r, len - keep).await?;
                head
            } else {
                skip(r, len).await?;
                parts.first().cloned().unwrap_or_default()
            };
            oversized = Some((head, size, reason));
            parts.clear();
            permits.clear();
        } else if let Some((_, biggest, reason)) = oversized.as_mut() {
            skip(r, len).await?;
            match reason {
                Oversize::Frame => *biggest = (*biggest).max(len),
                Oversize::Parts(n) => *n = count,
                Oversize::Message | Oversize::Budget => *biggest = total,
            }
        } else {
            parts.push(read_body(r, len).await?);
        }
        if !more {
            return Ok(match oversized {
                Some((head, len, reason)) => (
                    Inbound::Oversized {
                        head: head.slice(..head.len().min(OVERSIZE_HEAD_BYTES)),
                        len,
                        reason,
                    },
                    Vec::new(),
                ),
                None => (Inbound::Message(parts), permits),
            });
        }
    }
}

/// Writes a PONG for a PING's context (not flushed).
pub async fn pong<W: AsyncWrite + Unpin>(w: &mut W, context: &[u8]) -> std::io::Result<()> {
    write_frame(
        w,
        FLAG_COMMAND,
        &command("PONG", &context[..context.len().min(16)]),
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn limits(max_frame_bytes: usize) -> Limits {
        Limits {
            max_frame_bytes,
            max_parts: 3,
            handshake_timeout: Duration::from_secs(1),
        }
    }

    #[tokio::test]
    async fn handshake_between_router_and_dealer() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let server = tokio::spawn(async move {
            handshake(&mut a, true, "ROUTER", b"", &["DEALER"])
                .await
                .map(|i| (i, a))
        });
        let client = handshake(&mut b, false, "DEALER", b"me", &["ROUTER"])
            .await
            .unwrap();
        let (info, _a) = server.await.unwrap().unwrap();
        assert_eq!(info.socket_type, "DEALER");
        assert_eq!(info.identity, b"me");
        assert_eq!(client.socket_type, "ROUTER");
        assert_eq!(info.minor_version, 1);
    }

    #[tokio::test]
    async fn wrong_socket_types_are_refused_with_a_reason() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        let server =
            tokio::spawn(async move { handshake(&mut a, true, "ROUTER", b"", &["DEALER"]).await });
        let client = handshake(&mut b, false, "PUB", b"", &["ROUTER"]).await;
        let err = server.await.unwrap().unwrap_err();
        assert!(err.to_string().contains("cannot talk to a PUB"), "{err}");
        assert!(client.is_err() || client.is_ok());
    }

    #[tokio::test]
    async fn bytes_that_are_not_zmtp_are_named_as_such() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        b.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let err = handshake(&mut a, true, "ROUTER", b"", &["DEALER"])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ZmtpError::NotZmtp(head) if head == b"GET / HTTP/"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "not a ZMTP peer: it sent \"GET / HTTP/\" where a ZMTP greeting begins"
        );
    }

    #[tokio::test]
    async fn messages_round_trip_and_big_parts_use_long_frames() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let parts = vec![Bytes::from_static(b"x"), Bytes::from(vec![7u8; 1000])];
        write_message(&mut a, &parts).await.unwrap();
        match read_message(&mut b, &limits(4096)).await.unwrap() {
            Inbound::Message(got) => assert_eq!(got, parts),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn a_huge_declared_frame_is_skipped_not_allocated() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        // A frame that declares 1 TiB and then the connection ends: must be an error, not an
        // allocation.
        a.write_all(&[FLAG_LONG]).await.unwrap();
        a.write_all(&(1u64 << 40).to_be_bytes()).await.unwrap();
        a.write_all(b"KV\x01\x08abcdefgh-rest").await.unwrap();
        drop(a);
        assert!(matches!(
            read_message(&mut b, &limits(4096)).await,
            Err(ZmtpError::Closed)
        ));
    }

    #[tokio::test]
    async fn an_oversized_message_is_reported_with_its_head_and_the_stream_stays_usable() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let mut big = b"KV\x01\x08\x2a\0\0\0\0\0\0\0".to_vec();
        big.resize(10_000, 9);
        write_message(&mut a, &[Bytes::from(big), Bytes::from_static(b"tail")])
            .await
            .unwrap();
        write_message(&mut a, &[Bytes::from_static(b"next")])
            .await
            .unwrap();
        match read_message(&mut b, &limits(4096)).await.unwrap() {
            Inbound::Oversized { head, len, .. } => {
                assert_eq!(len, 10_000);
                assert_eq!(&head[..4], b"KV\x01\x08");
                assert_eq!(head.len(), OVERSIZE_HEAD_BYTES);
            }
            other => panic!("{other:?}"),
        }
        match read_message(&mut b, &limits(4096)).await.unwrap() {
            Inbound::Message(got) => assert_eq!(got, vec![Bytes::from_static(b"next")]),
            other => panic!("{other:?}"),
        }
        let parts: Vec<Bytes> = (0..5).map(|i| Bytes::from(vec![i as u8; 4])).collect();
        write_message(&mut a, &parts).await.unwrap();
        assert!(matches!(
            read_message(&mut b, &limits(4096)).await.unwrap(),
            Inbound::Oversized {
                reason: Oversize::Parts(5),
                ..
            }
        ));
    }

    #[tokio::test]
    async fn parts_that_add_up_past_the_frame_limit_are_refused_unbuffered() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        // Three parts of 3,000 bytes each: every part fits, the message does not.
        let parts: Vec<Bytes> = (0..3).map(|_| Bytes::from(vec![1u8; 3000])).collect();
        write_message(&mut a, &parts).await.unwrap();
        write_message(&mut a, &[Bytes::from_static(b"next")])
            .await
            .unwrap();
        let budget: Budget = Arc::new(Semaphore::new(1 << 20));
        let within = Duration::from_secs(5);
        match read_message_within(&mut b, &limits(4096), &budget, within)
            .await
            .unwrap()
        {
            (
                Inbound::Oversized {
                    len,
                    reason: Oversize::Message,
                    ..
                },
                held,
            ) => {
                assert_eq!(len, 9000);
                assert!(held.is_empty());
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(budget.available_permits(), 1 << 20, "nothing held");
        let (m, held) = read_message_within(&mut b, &limits(4096), &budget, within)
            .await
            .unwrap();
        assert!(matches!(m, Inbound::Message(p) if p == vec![Bytes::from_static(b"next")]));
        assert_eq!(
            budget.available_permits(),
            1 << 20,
            "small parts are not charged"
        );
        drop(held);
        assert_eq!(budget.available_permits(), 1 << 20);
    }

    #[tokio::test]
    async fn a_spent_budget_refuses_the_message_and_the_stream_stays_usable() {
        let (mut a, mut b) = tokio::io::duplex(1 << 20);
        let budget: Budget = Arc::new(Semaphore::new(10_000));
        let other = budget.clone().try_acquire_many_owned(9_000).unwrap();
        let within = Duration::from_secs(5);
        let mut frame = b"KV\x01\x08\x07\0\0\0\0\0\0\0".to_vec();
        frame.resize(5000, 0);
        write_message(&mut a, &[Bytes::from(frame.clone())])
            .await
            .unwrap();
        match read_message_within(&mut b, &limits(8192), &budget, within)
            .await
            .unwrap()
            .0
        {
            Inbound::Oversized { head, reason, .. } => {
                assert_eq!(reason, Oversize::Budget);
                assert_eq!(head[4], 7, "the request id survives");
            }
            other => panic!("{other:?}"),
        }
        drop(other);
        write_message(&mut a, &[Bytes::from(frame)]).await.unwrap();
        assert!(matches!(
            read_message_within(&mut b, &limits(8192), &budget, within)
                .await
                .unwrap()
                .0,
            Inbound::Message(_)
        ));
    }

    #[tokio::test]
    async fn a_message_begun_and_left_unfinished_times_out() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        // A header declaring 5,000 bytes, then 10 of them, then silence.
        a.write_all(&[FLAG_LONG]).await.unwrap();
        a.write_all(&5000u64.to_be_bytes()).await.unwrap();
        a.write_all(&[0u8; 10]).await.unwrap();
        let budget: Budget = Arc::new(Semaphore::new(8192));
        let r =
            read_message_within(&mut b, &limits(8192), &budget, Duration::from_millis(50)).await;
        assert!(
            matches!(&r, Err(ZmtpError::Protocol(m)) if m.contains("within 50ms")),
            "{r:?}"
        );
        assert_eq!(budget.available_permits(), 8192, "the budget comes back");
        drop(a);
    }

    #[tokio::test]
    async fn ping_is_surfaced_and_reserved_flags_are_refused() {
        let (mut a, mut b) = tokio::io::duplex(4096);
        write_frame(&mut a, FLAG_COMMAND, &command("PING", b"\x00\x10ctx"))
            .await
            .unwrap();
        match read_message(&mut b, &limits(4096)).await.unwrap() {
            Inbound::Ping(ctx) => assert_eq!(&ctx[..], b"ctx"),
            other => panic!("{other:?}"),
        }
        a.write_all(&[0x80, 0]).await.unwrap();
        assert!(matches!(
            read_message(&mut b, &limits(4096)).await,
            Err(ZmtpError::Protocol(_))
        ));
    }
}
