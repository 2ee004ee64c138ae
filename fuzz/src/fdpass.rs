//! The fd socket's header (`kvd_proto::fdpass::Header::decode`), checked against the format as
//! `docs/protocol.md` states it: `"KVFD"`, version 1, a count of at most 253, a non-zero token.

use kvd_proto::fdpass::{Header, HEADER_BYTES, MAX_FDS_PER_MESSAGE};

/// Decodes one header and compares the verdict with the format.
pub fn header(data: &[u8]) {
    let valid = data.len() == HEADER_BYTES
        && data.starts_with(b"KVFD\x01\x00")
        && usize::from(u16::from_le_bytes([data[6], data[7]])) <= MAX_FDS_PER_MESSAGE
        && data[8..].iter().any(|&b| b != 0);
    match Header::decode(data) {
        Some(h) => {
            assert!(valid, "accepted {data:02x?} as {h:?}");
            assert_eq!(&h.encode()[..], data);
        }
        None => assert!(!valid, "refused a valid header {data:02x?}"),
    }
}
