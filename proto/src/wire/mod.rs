//! The protocol (version [`PROTOCOL_VERSION`]): the wire types shared by the server and every
//! client (the Rust client in [`crate::client`] and, through it, the `kvd._native` Python
//! module), so the two ends are compiled from one definition and cannot drift, and the request
//! limits both ends keep to ([`limits`]). `docs/protocol.md` is the prose version.

pub mod codec;
pub mod frame;
pub mod limits;
pub mod messages;

pub use codec::DecodeError;
pub use frame::{decode_reply, decode_request, encode_reply, encode_request, Reply, Request};
pub use limits::{check_limits, MAX_CHUNKS_PER_REQUEST, MAX_SHARDS};
pub use messages::*;

/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u8 = 6;

/// Default largest frame, in bytes. A store or retrieve of 64k tokens of 16-token blocks
/// takes about 20 KiB, so this leaves room for far larger requests.
pub const DEFAULT_MAX_FRAME_BYTES: usize = 4 << 20;

/// Most records in one [`EventsReply`]: 4096 records are about 150 KiB, well inside the
/// smallest frame limit (1 MiB).
pub const MAX_EVENTS_PER_REPLY: u32 = 4096;
