//! Request handling. [`dispatch`] is the one place that decides how a request is answered:
//! on the spot (hello, ping, stats, events, lookup, release, unregister), by the device's copy worker
//! once it has taken the copy (store, retrieve: [`transfer`]), or by a task once the device
//! has imported the client's memory (register: [`register`]). It runs on the connection's own
//! task, so requests of one client are handled in arrival order and a busy client delays only
//! itself. Every request gets exactly one reply: its result or a [`RequestError`], which
//! becomes a wire error in one place ([`crate::control::error`]).

pub mod frames;
pub mod register;
pub mod transfer;

use std::sync::Arc;

use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use crate::control::error::RequestError;
use crate::control::router::{PeerId, RouterHandle, Ticket};
use crate::control::session::{ClientInfo, Region};
use crate::control::state::{Phase, State};
use crate::l1::cache::{Query, Want};
use crate::ops::metrics::Metrics;
use crate::tiers::fill::Registrations;
use crate::wire::*;

pub use register::SERVER_EVENT_SLOTS;

/// Where a request's reply goes. Sending it consumes it, so a request is answered once.
#[derive(Debug)]
pub struct ReplyTo {
    /// The peer that asked.
    pub peer: PeerId,
    /// Its request id.
    pub request_id: u64,
    op: &'static str,
    arrived: Instant,
    router: RouterHandle,
    metrics: Metrics,
    /// The peer's in-flight slot: freed once the reply is queued.
    _ticket: Ticket,
}

impl ReplyTo {
    /// A reply address for `request_id` of `peer`, for a request of kind `op` that arrived at
    /// `arrived` (the request-duration histogram runs from there to the reply), holding the
    /// peer's in-flight `ticket` until the reply is queued.
    pub fn new(
        router: RouterHandle,
        metrics: Metrics,
        peer: PeerId,
        request_id: u64,
        op: &'static str,
        arrived: Instant,
        ticket: Ticket,
    ) -> Self {
        ReplyTo {
            peer,
            request_id,
            op,
            arrived,
            router,
            metrics,
            _ticket: ticket,
        }
    }

    /// Sends the reply (an error becomes an error reply here).
    pub fn send(self, reply: Result<Reply, RequestError>) {
        let reply = reply.unwrap_or_else(Reply::from);
        if matches!(reply, Reply::Hello(_)) {
            // A client that said hello is no longer an anonymous connection.
            self.router.identified(self.peer);
        }
        self.metrics
            .answered(self.op, &reply, self.arrived.elapsed().as_secs_f64());
        if let Err(e) = self
            .router
            .send(self.peer, vec![encode_reply(self.request_id, &reply)])
        {
            tracing::debug!(peer = self.peer, "reply not delivered: {e}");
        }
    }
}

/// Handles one decoded request; see the module header.
pub fn dispatch(state: &Arc<State>, tasks: &TaskTracker, to: ReplyTo, req: Request) {
    let peer = to.peer;
    // Everything but a hello needs a session that has said hello.
    let session = match &req {
        Request::Hello(_) => 0,
        _ => match session_of(state, peer) {
            Ok(s) => s,
            Err(e) => return to.send(Err(e)),
        },
    };
    // The request limits, checked once here so that no handler or fill below sees more.
    if let Err(e) = check_limits(&req) {
        return to.send(Err(RequestError::Invalid(e)));
    }
    match req {
        Request::Hello(h) => to.send(hello(state, peer, &h)),
        Request::Ping(_) => to.send(Ok(Reply::Pong(Pong {
            uptime_ms: state.started.elapsed().as_millis() as u64,
        }))),
        Request::Stats(_) => to.send(Ok(stats(state))),
        Request::Events(e) => to.send(Ok(events(state, &e))),
        Request::Remember(r) => to.send(remember(state, r)),
        Request::Recall(r) => to.send(recall(state, &r)),
        Request::Lookup(l) => {
            // With tiers below L1, the lookup first has them bring what they hold beyond L1
            // into L1, nearest first (the chain: `tiers::chain`), and then answers from L1.
            let Some(tiers) = state.tiers.get().filter(|t| !t.is_empty()) else {
                return to.send(lookup(state, session, &l, Want::Prefix));
            };
            let l = Arc::new(l);
            let regs: Arc<dyn Registrations> = state.clone();
            let filling = tiers.fill(&state.l1, &regs, l.clone());
            if filling.is_done() {
                to.send(lookup(state, session, &l, Want::Prefix));
                drop(filling.into_head());
            } else {
                let state = state.clone();
                tasks.spawn(async move {
                    let head = filling.finish().await;
                    to.send(lookup(&state, session, &l, Want::Prefix));
                    drop(head);
                });
            }
        }
        // A state's lookup searches L1 only (protocol `LookupLast`).
        Request::LookupLast(l) => to.send(lookup(state, session, &l, Want::Last)),
        Request::Release(r) => to.send(Ok(Reply::Released(Released {
            chunks: state.l1.cache().release_own(session, r.pin_id),
        }))),
        Request::Unregister(u) => to.send(unregister(state, peer, u.region)),
        Request::Store(s) => transfer::store(state, tasks, to, s),
        Request::Retrieve(r) => transfer::retrieve(state, tasks, to, r),
        Request::Register(r) => {
            let state = state.clone();
            tasks.spawn(async move {
                let reply = register::register(&state, peer, r).await;
                to.send(reply);
            });
        }
    }
}

/// Answers a hello: the first request of a session.
fn hello(state: &State, peer: PeerId, h: &Hello) -> Result<Reply, RequestError> {
    if h.protocol_version != PROTOCOL_VERSION as u16 {
        return Err(RequestError::Version(format!(
            "client speaks kvd protocol {} but this kvd ({}) speaks {}; install the kvd \
             client package that matches this server",
            h.protocol_version,
            env!("CARGO_PKG_VERSION"),
            PROTOCOL_VERSION
        )));
    }
    let mut sessions = state.sessions.lock();
    let Some(session) = sessions.get_mut(peer) else {
        return Err(RequestError::Internal(
            "no session for this connection".into(),
        ));
    };
    session.client = Some(ClientInfo {
        name: h.client.clone(),
        pid: h.pid,
        role: h.role,
    });
    tracing::info!(session = session.id, client = %h.client, pid = h.pid, role = ?h.role, "hello");
    Ok(Reply::Hello(HelloOk {
        protocol_version: PROTOCOL_VERSION as u16,
        server_version: env!("CARGO_PKG_VERSION").to_string(),
        session_id: session.id,
        chunk_tokens: state.settings.chunk_tokens,
        fd_socket: state.settings.fd_socket.display().to_string(),
        session_timeout_ms: state.settings.session_timeout.as_millis() as u32,
        max_frame_bytes: state.settings.max_frame_bytes as u32,
        presence: state
            .l1
            .cache()
            .presence_path()
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
    }))
}

/// The session of a peer that has said hello.
fn session_of(state: &State, peer: PeerId) -> Result<u64, RequestError> {
    match state.sessions.lock().get(peer) {
        Some(s) if s.client.is_some() => Ok(s.id),
        Some(_) => Err(RequestError::HelloRequired),
        None => Err(RequestError::Internal(
            "no session for this connection".into(),
        )),
    }
}

/// A region registered by this peer.
fn region_for(state: &State, peer: PeerId, id: u32) -> Result<Arc<Region>, RequestError> {
    state
        .sessions
        .lock()
        .region(peer, id)
        .ok_or(RequestError::UnknownRegion(id))
}

fn unregister(state: &State, peer: PeerId, region: u32) -> Result<Reply, RequestError> {
    if !state.sessions.lock().remove_region(peer, region) {
        return Err(RequestError::UnknownRegion(region));
    }
    state.refresh_metrics();
    Ok(Reply::Unregistered)
}

fn stats(state: &State) -> Reply {
    let s = state.l1.cache().stats();
    let sessions = state.sessions.lock();
    Reply::Stats(Stats {
        pool_bytes_total: s.total_bytes,
        pool_bytes_used: s.usage.used_bytes,
        chunks: s.entries,
        pinned_pages: s.pinned_pages,
        sessions: sessions.session_count() as u32,
        regions: sessions.region_count() as u32,
        evictions: s.counters.evictions,
        store_refusals: s.counters.store_refusals,
    })
}

/// Reads the removal feed: at most `max` records (and never more than a reply may carry).
fn events(state: &State, e: &Events) -> Reply {
    let max = e.max.min(MAX_EVENTS_PER_REPLY) as usize;
    let page = state.l1.cache().removals().read(e.since, max);
    state.metrics.events_dropped.inc_by(page.dropped);
    Reply::Events(EventsReply {
        records: page
            .records
            .iter()
            .map(|k| RemovedChunk {
                fingerprint: k.fingerprint,
                salt: k.salt,
                shard: k.shard,
                hash: k.hash,
            })
            .collect(),
        next: page.next,
        dropped: page.dropped,
    })
}

/// Keeps a served prompt under its replica's name ([`crate::control::recall`]).
fn remember(state: &State, r: Remember) -> Result<Reply, RequestError> {
    let prompts = state
        .recall
        .lock()
        .remember(&r.group, r.salt, r.tokens, Instant::now())
        .map_err(|e| RequestError::Invalid(e.0))?;
    Ok(Reply::Remembered(Remembered {
        prompts: prompts as u32,
    }))
}

/// One prompt a replica's name holds, the newest first.
fn recall(state: &State, r: &Recall) -> Result<Reply, RequestError> {
    crate::control::recall::check_group(&r.group).map_err(|e| RequestError::Invalid(e.0))?;
    let (prompt, prompts) = state.recall.lock().recall(&r.group, r.index as usize);
    Ok(Reply::Recalled(Recalled {
        prompt: prompt.map(|p| RecalledPrompt {
            salt: p.salt.clone(),
            tokens: p.tokens.clone(),
            age_ms: p.at.elapsed().as_millis() as u64,
        }),
        prompts: prompts as u32,
    }))
}

/// The cache's query for lookup `l`, wanting `want` of its chunks, `below` saying which of
/// those the client holds a tier below L1 holds.
fn query<'a>(l: &'a Lookup, want: Want, below: &'a [bool]) -> Query<'a> {
    Query {
        fingerprint: l.fingerprint,
        salt: l.salt,
        shards: &l.shards,
        hashes: &l.hashes,
        want,
        pin: l.pin.then_some(l.readers),
        held: l.held as usize,
        below,
    }
}

/// Which of the chunks lookup `l`'s client holds already the disk tier holds on every shard
/// (none without one): those count towards the hit where L1 lacks them, unread, since the
/// client loads none of them ([`crate::tiers::disk::fill`] reads from the first it lacks).
fn held_below(state: &State, l: &Lookup) -> Vec<bool> {
    let held = (l.held as usize).min(l.hashes.len());
    match state.tiers.get().and_then(|t| t.disk.as_ref()) {
        Some(disk) if held > 0 => disk.holds_chunks(l, &l.hashes[..held]),
        _ => Vec::new(),
    }
}

/// Answers a lookup of either kind (within the request limits: [`dispatch`] checked them). A
/// state group's lookup (`Want::Last`) counts as one lookup and one chunk hit or missed.
fn lookup(state: &State, session: u64, l: &Lookup, want: Want) -> Result<Reply, RequestError> {
    check_lookup(l)?;
    let below = match want {
        Want::Prefix => held_below(state, l),
        Want::Last => Vec::new(),
    };
    let (hit, pin_id) = state.l1.cache().lookup(
        session,
        &query(l, want, &below),
        Instant::now(),
        state.settings.pin_timeout,
    );
    let (hit_chunks, missed_chunks) = match want {
        Want::Prefix => (
            hit as u64,
            (l.hashes.len() as u64).saturating_sub(hit as u64),
        ),
        Want::Last => (u64::from(hit > 0), u64::from(hit == 0)),
    };
    let m = &state.metrics;
    m.lookups
        .with_label_values(&[if hit > 0 { "hit" } else { "miss" }])
        .inc();
    m.lookup_chunks
        .with_label_values(&["hit"])
        .inc_by(hit_chunks);
    m.lookup_chunks
        .with_label_values(&["miss"])
        .inc_by(missed_chunks);
    Ok(Reply::Lookup(LookupReply {
        hit_chunks: hit,
        pin_id,
    }))
}

/// What a lookup needs beyond the request limits.
fn check_lookup(l: &Lookup) -> Result<(), RequestError> {
    if l.shards.is_empty() {
        return Err(RequestError::Invalid(
            "a lookup must name at least one shard".into(),
        ));
    }
    Ok(())
}

/// Why kvd cannot serve a registration yet.
fn not_ready(state: &State) -> RequestError {
    let why = match state.phase() {
        Phase::Populating { fraction, .. } => format!(
            "kvd is still populating its pool ({:.0}%)",
            fraction * 100.0
        ),
        Phase::Pinning => "kvd is pinning its pool for DMA".to_string(),
        Phase::Failed(e) => {
            return RequestError::Gpu(kvd_gpu::GpuError::Unavailable(format!(
                "kvd has no pool: {e}"
            )))
        }
        Phase::ShuttingDown => return RequestError::ShuttingDown("kvd is shutting down".into()),
        _ => "kvd is starting".to_string(),
    };
    RequestError::NotReady(why)
}
