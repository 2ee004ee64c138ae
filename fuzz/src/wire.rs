//! Request and reply frames (`kvd_proto::wire`): decoding never panics and is canonical — a
//! frame that decodes encodes back to exactly its own bytes, so no two frames mean one message
//! and nothing a peer sent is silently dropped.

use kvd_proto::wire::frame::peek_header;
use kvd_proto::wire::{
    decode_reply, decode_request, encode_reply, encode_request, DEFAULT_MAX_FRAME_BYTES,
};

/// `decode_request`, then the round trip.
pub fn request(data: &[u8]) {
    if let Ok((id, req)) = decode_request(data, DEFAULT_MAX_FRAME_BYTES) {
        let header = peek_header(data).expect("a decoded frame has a header");
        assert_eq!(header.request_id, id);
        assert_eq!(header.kind, req.kind());
        assert_eq!(
            &encode_request(id, &req)[..],
            data,
            "{req:?} does not encode back to its frame"
        );
    }
}

/// `decode_reply`, then the round trip.
pub fn reply(data: &[u8]) {
    if let Ok((id, reply)) = decode_reply(data, DEFAULT_MAX_FRAME_BYTES) {
        assert_eq!(
            peek_header(data)
                .expect("a decoded frame has a header")
                .request_id,
            id
        );
        assert_eq!(
            &encode_reply(id, &reply)[..],
            data,
            "{reply:?} does not encode back to its frame"
        );
    }
}
