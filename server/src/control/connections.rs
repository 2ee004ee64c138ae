//! Connections and sessions: a session opens and closes with its connection (releasing its
//! pins and registrations), every message goes to the handler on the connection's own task,
//! and once a second the control loop reaps what outlived its time.

use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use super::handler::frames;
use super::router::{EventSink, PeerId, RouterEvent, RouterHandle};
use super::state::{State, FD_STASH_MAX_AGE};

/// Handles the router's events on each connection's own task: sessions open and close with
/// connections, and every message goes to [`frames::on_message`], which decodes it and
/// dispatches the request.
pub struct Dispatcher {
    state: Arc<State>,
    /// Requests that outlive their dispatch (registrations), awaited at shutdown.
    requests: TaskTracker,
}

impl Dispatcher {
    /// Dispatches into `state`, tracking the requests that outlive their dispatch in
    /// `requests`.
    pub fn new(state: Arc<State>, requests: TaskTracker) -> Dispatcher {
        Dispatcher { state, requests }
    }
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher").finish_non_exhaustive()
    }
}

impl EventSink for Dispatcher {
    fn on_event(&self, router: &RouterHandle, ev: RouterEvent) {
        let state = &self.state;
        match ev {
            RouterEvent::Connected { peer, info } => {
                let id = state.sessions.lock().open(peer, Instant::now());
                tracing::debug!(peer, session = id, socket_type = %info.socket_type, "connected");
            }
            RouterEvent::Disconnected { peer, reason } => end_session(state, peer, &reason),
            RouterEvent::Oversized {
                peer,
                head,
                len,
                reason,
            } => frames::refused(state, router, peer, &head, len, reason),
            RouterEvent::Message {
                peer,
                parts,
                ticket,
            } => frames::on_message(state, &self.requests, router, peer, parts, ticket),
        }
    }
}

fn end_session(state: &State, peer: PeerId, reason: &str) {
    let ended = state.sessions.lock().close(peer);
    if let Some(id) = ended.id {
        let pins = state.l1.cache().release_owner(id);
        tracing::info!(
            session = id,
            "session ended ({reason}): released {pins} pinned chunks and {} registrations",
            ended.regions
        );
        state.refresh_metrics();
    }
}

/// The control loop's housekeeping, once a second: lookup pins and holds past their time,
/// descriptors no registration claimed, sessions silent past `--session-timeout-ms`.
pub fn reap(state: &State, router: &RouterHandle) {
    let now = Instant::now();
    let expired = state.l1.cache().expire(now);
    if expired > 0 {
        tracing::debug!("{expired} lookup pins timed out");
    }
    let closed = state.fds.expire(FD_STASH_MAX_AGE);
    state.metrics.fd_stashed.set(state.fds.held() as i64);
    if closed > 0 {
        tracing::warn!("closed {closed} shared descriptors that no registration claimed within {FD_STASH_MAX_AGE:?}");
    }
    let cutoff = now
        .checked_sub(state.settings.session_timeout)
        .unwrap_or(now);
    let silent = state.sessions.lock().silent_since(cutoff);
    for peer in silent {
        state.metrics.sessions_timed_out.inc();
        router.disconnect(peer);
        end_session(state, peer, "silent past --session-timeout-ms");
    }
}
