//! Frames: a 12-byte header — `"KV"`, protocol version, message kind, request id — then the
//! message. A reply echoes the request id and its kind is the request's with the high bit set;
//! errors use kind `0xFF`.

use bytes::{BufMut, Bytes, BytesMut};

use super::codec::{DecodeError, Reader, Wire};
use super::messages::*;
use super::PROTOCOL_VERSION;

/// Frame header bytes.
pub const HEADER_BYTES: usize = 12;
const MAGIC: [u8; 2] = *b"KV";

/// A request.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum Request {
    /// Starts a session.
    Hello(Hello),
    /// Registers a KV cache.
    Register(Register),
    /// Drops a registration.
    Unregister(Unregister),
    /// Prefix lookup.
    Lookup(Lookup),
    /// Device → pool.
    Store(Store),
    /// Pool → device.
    Retrieve(Retrieve),
    /// Drops a pin.
    Release(Release),
    /// Liveness.
    Ping(Ping),
    /// Counters.
    Stats(StatsRequest),
    /// The removal feed.
    Events(Events),
    /// State lookup: the last of the chunks named that is stored (a Mamba group's state at a
    /// chunk boundary stands alone; it needs no chunk before it).
    LookupLast(Lookup),
    /// Keeps a served prompt under a replica's name.
    Remember(Remember),
    /// One prompt a replica's name holds.
    Recall(Recall),
}

/// A reply.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(test, derive(proptest_derive::Arbitrary))]
pub enum Reply {
    /// To [`Request::Hello`].
    Hello(HelloOk),
    /// To [`Request::Register`].
    Registered(Registered),
    /// To [`Request::Unregister`].
    Unregistered,
    /// To [`Request::Lookup`] and [`Request::LookupLast`].
    Lookup(LookupReply),
    /// To [`Request::Store`].
    Store(StoreReply),
    /// To [`Request::Retrieve`].
    Retrieve(RetrieveReply),
    /// To [`Request::Release`].
    Released(Released),
    /// To [`Request::Ping`].
    Pong(Pong),
    /// To [`Request::Stats`].
    Stats(Stats),
    /// To [`Request::Events`].
    Events(EventsReply),
    /// To [`Request::Remember`].
    Remembered(Remembered),
    /// To [`Request::Recall`].
    Recalled(Recalled),
    /// To any request that failed.
    Error(ErrorReply),
}

impl Request {
    /// The kind byte.
    pub fn kind(&self) -> u8 {
        match self {
            Request::Hello(_) => 1,
            Request::Register(_) => 2,
            Request::Unregister(_) => 3,
            Request::Lookup(_) => 4,
            Request::Store(_) => 5,
            Request::Retrieve(_) => 6,
            Request::Release(_) => 7,
            Request::Ping(_) => 8,
            Request::Stats(_) => 9,
            Request::Events(_) => 10,
            Request::LookupLast(_) => 11,
            Request::Remember(_) => 12,
            Request::Recall(_) => 13,
        }
    }

    /// A short name for logs and metric labels.
    pub fn op_name(&self) -> &'static str {
        op_name(self.kind())
    }
}

/// Name of a request kind, for metric labels; `unknown` for kinds this build does not know.
pub fn op_name(kind: u8) -> &'static str {
    match kind {
        1 => "hello",
        2 => "register",
        3 => "unregister",
        4 => "lookup",
        5 => "store",
        6 => "retrieve",
        7 => "release",
        8 => "ping",
        9 => "stats",
        10 => "events",
        11 => "lookup_last",
        12 => "remember",
        13 => "recall",
        _ => "unknown",
    }
}

impl Reply {
    fn kind(&self) -> u8 {
        match self {
            Reply::Hello(_) => 0x81,
            Reply::Registered(_) => 0x82,
            Reply::Unregistered => 0x83,
            Reply::Lookup(_) => 0x84,
            Reply::Store(_) => 0x85,
            Reply::Retrieve(_) => 0x86,
            Reply::Released(_) => 0x87,
            Reply::Pong(_) => 0x88,
            Reply::Stats(_) => 0x89,
            Reply::Events(_) => 0x8A,
            Reply::Remembered(_) => 0x8C,
            Reply::Recalled(_) => 0x8D,
            Reply::Error(_) => 0xFF,
        }
    }

    /// An error reply.
    pub fn error(code: ErrorCode, message: impl Into<String>) -> Reply {
        Reply::Error(ErrorReply {
            code,
            message: message.into(),
        })
    }
}

/// What the header says, readable even when the body is not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Protocol version in the frame.
    pub version: u8,
    /// Message kind.
    pub kind: u8,
    /// Request id, echoed in the reply.
    pub request_id: u64,
}

/// Reads the header; a frame too short or without the magic has none.
pub fn peek_header(frame: &[u8]) -> Result<Header, DecodeError> {
    let mut r = Reader::new(frame);
    if r.take(2)? != MAGIC {
        return Err(DecodeError::BadMagic);
    }
    Ok(Header {
        version: u8::decode(&mut r)?,
        kind: u8::decode(&mut r)?,
        request_id: u64::decode(&mut r)?,
    })
}

fn frame(kind: u8, request_id: u64, body: impl FnOnce(&mut BytesMut)) -> Bytes {
    let mut out = BytesMut::with_capacity(64);
    out.put_slice(&MAGIC);
    out.put_u8(PROTOCOL_VERSION);
    out.put_u8(kind);
    out.put_u64_le(request_id);
    body(&mut out);
    out.freeze()
}

/// Encodes a request frame.
pub fn encode_request(request_id: u64, req: &Request) -> Bytes {
    frame(req.kind(), request_id, |out| match req {
        Request::Hello(m) => m.encode(out),
        Request::Register(m) => m.encode(out),
        Request::Unregister(m) => m.encode(out),
        Request::Lookup(m) => m.encode(out),
        Request::Store(m) => m.encode(out),
        Request::Retrieve(m) => m.encode(out),
        Request::Release(m) => m.encode(out),
        Request::Ping(m) => m.encode(out),
        Request::Stats(m) => m.encode(out),
        Request::Events(m) => m.encode(out),
        Request::LookupLast(m) => m.encode(out),
        Request::Remember(m) => m.encode(out),
        Request::Recall(m) => m.encode(out),
    })
}

/// Encodes a reply frame.
pub fn encode_reply(request_id: u64, reply: &Reply) -> Bytes {
    frame(reply.kind(), request_id, |out| match reply {
        Reply::Hello(m) => m.encode(out),
        Reply::Registered(m) => m.encode(out),
        Reply::Unregistered => {}
        Reply::Lookup(m) => m.encode(out),
        Reply::Store(m) => m.encode(out),
        Reply::Retrieve(m) => m.encode(out),
        Reply::Released(m) => m.encode(out),
        Reply::Pong(m) => m.encode(out),
        Reply::Stats(m) => m.encode(out),
        Reply::Events(m) => m.encode(out),
        Reply::Remembered(m) => m.encode(out),
        Reply::Recalled(m) => m.encode(out),
        Reply::Error(m) => m.encode(out),
    })
}

fn body<T: Wire>(r: &mut Reader<'_>) -> Result<T, DecodeError> {
    let v = T::decode(r)?;
    r.finish()?;
    Ok(v)
}

fn check_header(frame: &[u8], max_frame_bytes: usize) -> Result<Header, DecodeError> {
    if frame.len() > max_frame_bytes {
        return Err(DecodeError::FrameTooLarge {
            len: frame.len(),
            max: max_frame_bytes,
        });
    }
    let header = peek_header(frame)?;
    if header.version != PROTOCOL_VERSION {
        return Err(DecodeError::Version {
            got: header.version,
            want: PROTOCOL_VERSION,
        });
    }
    Ok(header)
}

/// Decodes a request frame of at most `max_frame_bytes`.
pub fn decode_request(frame: &[u8], max_frame_bytes: usize) -> Result<(u64, Request), DecodeError> {
    let header = check_header(frame, max_frame_bytes)?;
    let mut r = Reader::new(&frame[HEADER_BYTES..]);
    let req = match header.kind {
        1 => Request::Hello(body(&mut r)?),
        2 => Request::Register(body(&mut r)?),
        3 => Request::Unregister(body(&mut r)?),
        4 => Request::Lookup(body(&mut r)?),
        5 => Request::Store(body(&mut r)?),
        6 => Request::Retrieve(body(&mut r)?),
        7 => Request::Release(body(&mut r)?),
        8 => Request::Ping(body(&mut r)?),
        9 => Request::Stats(body(&mut r)?),
        10 => Request::Events(body(&mut r)?),
        11 => Request::LookupLast(body(&mut r)?),
        12 => Request::Remember(body(&mut r)?),
        13 => Request::Recall(body(&mut r)?),
        k => return Err(DecodeError::UnknownKind(k)),
    };
    Ok((header.request_id, req))
}

/// Decodes a reply frame of at most `max_frame_bytes`.
pub fn decode_reply(frame: &[u8], max_frame_bytes: usize) -> Result<(u64, Reply), DecodeError> {
    let header = check_header(frame, max_frame_bytes)?;
    let mut r = Reader::new(&frame[HEADER_BYTES..]);
    let reply = match header.kind {
        0x81 => Reply::Hello(body(&mut r)?),
        0x82 => Reply::Registered(body(&mut r)?),
        0x83 => {
            r.finish()?;
            Reply::Unregistered
        }
        0x84 => Reply::Lookup(body(&mut r)?),
        0x85 => Reply::Store(body(&mut r)?),
        0x86 => Reply::Retrieve(body(&mut r)?),
        0x87 => Reply::Released(body(&mut r)?),
        0x88 => Reply::Pong(body(&mut r)?),
        0x89 => Reply::Stats(body(&mut r)?),
        0x8A => Reply::Events(body(&mut r)?),
        0x8C => Reply::Remembered(body(&mut r)?),
        0x8D => Reply::Recalled(body(&mut r)?),
        0xFF => Reply::Error(body(&mut r)?),
        k => return Err(DecodeError::UnknownKind(k)),
    };
    Ok((header.request_id, reply))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MAX: usize = 64 << 20;

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn requests_round_trip(id in any::<u64>(), req in any::<Request>()) {
            let frame = encode_request(id, &req);
            prop_assert_eq!(decode_request(&frame, MAX), Ok((id, req)));
        }

        #[test]
        fn replies_round_trip(id in any::<u64>(), reply in any::<Reply>()) {
            let frame = encode_reply(id, &reply);
            prop_assert_eq!(decode_reply(&frame, MAX), Ok((id, reply)));
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode_request(&bytes, MAX);
            let _ = decode_reply(&bytes, MAX);
        }

        #[test]
        fn damaged_frames_never_panic(
            id in any::<u64>(),
            req in any::<Request>(),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            xor in 1u8..,
        ) {
            let frame = encode_request(id, &req).to_vec();
            let truncated = &frame[..cut.index(frame.len())];
            prop_assert!(decode_request(truncated, MAX).is_err());
            let mut flipped = frame.clone();
            let at = flip.index(flipped.len());
            flipped[at] ^= xor;
            let _ = decode_request(&flipped, MAX);
        }
    }

    #[test]
    fn version_and_magic_are_checked_before_the_body() {
        let mut frame = encode_request(7, &Request::Ping(Ping {})).to_vec();
        frame[2] = PROTOCOL_VERSION + 1;
        assert_eq!(
            decode_request(&frame, MAX),
            Err(DecodeError::Version {
                got: PROTOCOL_VERSION + 1,
                want: PROTOCOL_VERSION
            })
        );
        assert_eq!(peek_header(&frame).unwrap().request_id, 7);
        assert_eq!(
            decode_request(b"GET / HTTP/1.1", MAX),
            Err(DecodeError::BadMagic)
        );
        let frame = encode_request(1, &Request::Ping(Ping {}));
        assert!(matches!(
            decode_request(&frame, 4),
            Err(DecodeError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn a_full_events_reply_fits_the_smallest_frame_limit() {
        // --max-frame-mb is at least 1, and clients decode replies under the same limit.
        let record = RemovedChunk {
            fingerprint: u64::MAX,
            salt: u64::MAX,
            shard: u32::MAX,
            hash: u128::MAX,
        };
        let reply = Reply::Events(EventsReply {
            records: vec![record; crate::wire::MAX_EVENTS_PER_REPLY as usize],
            next: u64::MAX,
            dropped: u64::MAX,
        });
        let frame = encode_reply(3, &reply);
        assert!(frame.len() < 1 << 20, "{} bytes", frame.len());
        assert_eq!(decode_reply(&frame, 1 << 20), Ok((3, reply)));
    }

    #[test]
    fn an_events_request_is_kind_10_and_its_reply_0x8a() {
        // Kinds are the protocol: a new op takes a new kind, and old kinds never move.
        let req = Request::Events(Events { since: 7, max: 9 });
        assert_eq!(req.kind(), 10);
        assert_eq!(req.op_name(), "events");
        let frame = encode_reply(
            1,
            &Reply::Events(EventsReply {
                records: vec![],
                next: 0,
                dropped: 0,
            }),
        );
        assert_eq!(peek_header(&frame).unwrap().kind, 0x8A);
    }

    #[test]
    fn trailing_bytes_are_refused() {
        let mut frame = encode_request(1, &Request::Ping(Ping {})).to_vec();
        frame.push(0);
        assert_eq!(
            decode_request(&frame, MAX),
            Err(DecodeError::TrailingBytes(1))
        );
    }
}
