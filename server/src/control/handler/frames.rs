//! From frames to requests: each message a connection receives is checked to be one frame and
//! decoded (bounded by `--max-frame-mb`), then handed to [`super::dispatch`]; a message that is
//! not a request gets its error reply here, with the request id when its header can be read, and
//! is counted in `kvd_malformed_frames_total` by reason. Runs on the connection's own task.

use bytes::Bytes;
use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::ReplyTo;
use crate::control::error::RequestError;
use crate::control::router::{PeerId, RouterHandle, Ticket};
use crate::control::state::State;
use crate::wire::frame::{op_name, peek_header};
use crate::wire::{decode_request, encode_reply, DecodeError, Reply};
use crate::zmtp::Oversize;

/// Decodes one message from `peer` and dispatches it, or answers why it is not a request.
pub(crate) fn on_message(
    state: &std::sync::Arc<State>,
    requests: &TaskTracker,
    router: &RouterHandle,
    peer: PeerId,
    parts: Vec<Bytes>,
    ticket: Ticket,
) {
    let arrived = Instant::now();
    if parts.len() != 1 {
        state
            .metrics
            .malformed_frames
            .with_label_values(&["parts"])
            .inc();
        let id = parts
            .first()
            .and_then(|f| peek_header(f).ok())
            .map(|h| h.request_id)
            .unwrap_or(0);
        let err = RequestError::Malformed(format!(
            "malformed message: a request is one frame, this message had {} parts; send one frame per request",
            parts.len()
        ));
        send(router, peer, id, &err.into());
        return;
    }
    let frame = &parts[0];
    let (request_id, req) = match decode_request(frame, state.settings.max_frame_bytes) {
        Ok(v) => v,
        Err(e) => return malformed(state, router, peer, Some(frame), &e),
    };
    if let Some(s) = state.sessions.lock().get_mut(peer) {
        s.last_seen = arrived;
    }
    let to = ReplyTo::new(
        router.clone(),
        state.metrics.clone(),
        peer,
        request_id,
        op_name(req.kind()),
        arrived,
        ticket,
    );
    super::dispatch(state, requests, to, req);
}

fn send(router: &RouterHandle, peer: PeerId, request_id: u64, reply: &Reply) {
    if let Err(e) = router.send(peer, vec![encode_reply(request_id, reply)]) {
        tracing::debug!(peer, "reply not delivered: {e}");
    }
}

fn malformed(
    state: &State,
    router: &RouterHandle,
    peer: PeerId,
    frame: Option<&Bytes>,
    err: &DecodeError,
) {
    let reason = match err {
        DecodeError::FrameTooLarge { .. } => "too_large",
        DecodeError::BadMagic => "bad_magic",
        DecodeError::Version { .. } => "version",
        DecodeError::UnknownKind(_) => "unknown_kind",
        DecodeError::Truncated { .. } | DecodeError::TrailingBytes(_) => "bad_length",
        _ => "bad_field",
    };
    state
        .metrics
        .malformed_frames
        .with_label_values(&[reason])
        .inc();
    let request_id = frame
        .and_then(|f| peek_header(f).ok())
        .map(|h| h.request_id)
        .unwrap_or(0);
    let error = match err {
        DecodeError::Version { got, want } => RequestError::Version(format!(
            "frame speaks kvd protocol {got}; this kvd speaks {want}; install the client package that matches this server"
        )),
        DecodeError::FrameTooLarge { .. } => RequestError::Malformed(format!(
            "{err}; split the request or start kvd with a larger --max-frame-mb"
        )),
        // A newer client asking for an op this build lacks (such as events, kind 10).
        DecodeError::UnknownKind(_) => RequestError::Malformed(format!(
            "{err}: this kvd ({}) does not know that request; upgrade kvd to use it",
            env!("CARGO_PKG_VERSION")
        )),
        _ => RequestError::Malformed(format!("malformed frame: {err}")),
    };
    tracing::debug!(peer, request_id, "malformed frame: {err}");
    send(router, peer, request_id, &error.into());
}

/// Answers a message the router skipped unread because a limit refused it.
pub(crate) fn refused(
    state: &State,
    router: &RouterHandle,
    peer: PeerId,
    head: &Bytes,
    len: u64,
    reason: Oversize,
) {
    let max = state.settings.max_frame_bytes;
    let (label, message) = match reason {
        Oversize::Frame | Oversize::Message => {
            let err = DecodeError::FrameTooLarge {
                len: len as usize,
                max,
            };
            return malformed(state, router, peer, Some(head), &err);
        }
        Oversize::Parts(n) => (
            "parts",
            format!("malformed message: {n} parts; send one frame per request"),
        ),
        Oversize::Budget => (
            "no_buffer",
            format!(
                "kvd is holding --max-buffered-mb {} MiB of other requests; this {len}-byte request was dropped unread, retry",
                state.settings.max_buffered_bytes >> 20
            ),
        ),
    };
    state
        .metrics
        .malformed_frames
        .with_label_values(&[label])
        .inc();
    let id = peek_header(head).map(|h| h.request_id).unwrap_or(0);
    let error = if reason == Oversize::Budget {
        RequestError::Busy(message)
    } else {
        RequestError::Malformed(message)
    };
    send(router, peer, id, &error.into());
}
