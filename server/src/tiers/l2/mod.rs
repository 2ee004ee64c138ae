//! The L2 tier, shared by every node's kvd. L1 is the pinned pool and stays the only tier that
//! touches a GPU; an L2 sits behind [`L2Store`], a batched asynchronous get/put of
//! whole chunks. The Valkey/Redis adapter ([`redis`]) is the first; a local-NVMe or NIXL/RDMA
//! adapter implements the same trait (see docs/tiers.md, "L2 and several nodes").
//!
//! L2 is never on vLLM's critical path:
//! - a lookup that L1 does not answer in full asks L2 for the rest in one batched round trip
//!   under `--l2-deadline-ms` (a slow or failed L2 is a miss, never a stall); the longest
//!   prefix held on every shard is written into fresh L1 pages on a blocking thread while those
//!   pages are invisible to lookups, and then the ordinary L1 lookup pins and reports it, so the
//!   retrieve is the usual DMA from L1 ([`fill`]);
//! - a store's chunks are written behind once their copy into L1 has completed, in batches,
//!   through a bounded queue; what does not fit is dropped and counted, and no store reply ever
//!   waits for L2 ([`write`]);
//! - L1 eviction does nothing for L2: chunks were written when stored, so evicting one that L2
//!   holds costs nothing, and one that L2 never got is simply gone from both.
//!
//! Every value carries a header ([`crate::tiers::value`]) checked before a byte reaches an L1
//! page.

pub mod config;
pub mod fill;
pub mod metrics;
pub mod redis;
pub mod secret;
pub mod url;
pub mod write;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::l1::cache::Key;
use crate::l1::L1;
use crate::tiers::fill::{Fill, Registrations, Tier};
use crate::tiers::value;
use crate::wire::Lookup;
use config::L2Config;
use metrics::L2Metrics;

/// A boxed future, for the object-safe [`L2Store`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Why an L2 operation failed. All of them leave L1 serving.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum L2Error {
    /// Not reachable (refused, reset, timed out, cluster down); the adapter reconnects.
    #[error("L2 {op}: unavailable: {message}")]
    Unavailable {
        /// The operation.
        op: &'static str,
        /// The client's reason.
        message: String,
    },
    /// The server refused the write because it is at maxmemory.
    #[error("L2 {op}: full: {message}; give the server a maxmemory-policy that evicts (allkeys-lru) or more memory")]
    Full {
        /// The operation.
        op: &'static str,
        /// The server's reason.
        message: String,
    },
    /// Anything else the server or client reported.
    #[error("L2 {op}: {message}")]
    Failed {
        /// The operation.
        op: &'static str,
        /// The reason.
        message: String,
    },
}

impl L2Error {
    /// The `kind` label of `kvd_l2_errors_total`.
    pub fn kind(&self) -> &'static str {
        match self {
            L2Error::Unavailable { .. } => "unavailable",
            L2Error::Full { .. } => "full",
            L2Error::Failed { .. } => "failed",
        }
    }

    /// The `op` label of `kvd_l2_errors_total`.
    pub fn op(&self) -> &'static str {
        match self {
            L2Error::Unavailable { op, .. }
            | L2Error::Full { op, .. }
            | L2Error::Failed { op, .. } => op,
        }
    }
}

/// A tier below L1: whole chunks by key, in batches. Values are opaque to it (kvd seals and
/// checks them); an implementation MUST return a value only for the key it was put under, MAY
/// lose any value at any time, and MUST NOT block the calling thread — its futures run on
/// tokio's workers.
pub trait L2Store: Send + Sync + std::fmt::Debug + 'static {
    /// Where it is, for logs and `/healthz`.
    fn describe(&self) -> String;
    /// The name a key has in this store (values carry a tag of it).
    fn name_of(&self, key: &Key) -> String;
    /// One result per key, `None` for absent, fetched together.
    fn get_many<'a>(
        &'a self,
        keys: &'a [Key],
    ) -> BoxFuture<'a, Vec<Result<Option<Vec<u8>>, L2Error>>>;
    /// Writes values, together; one result per item.
    fn put_many(&self, items: Vec<(Key, Vec<u8>)>) -> BoxFuture<'_, Vec<Result<(), L2Error>>>;
    /// A cheap round trip, for the health state.
    fn ping(&self) -> BoxFuture<'_, Result<(), L2Error>>;
}

/// What `/healthz` says about L2.
#[derive(Debug, Clone, PartialEq)]
pub struct L2Health {
    /// `up`, `degraded` (requests to some nodes fail while others succeed — a cluster that
    /// lost a node), or `down` (the probe gets no answer and no request has succeeded lately).
    pub state: &'static str,
    /// The last error, if any since start.
    pub last_error: Option<String>,
    /// How long ago it happened, in seconds.
    pub last_error_age_s: Option<f64>,
    /// Whether it still applies (L2 is not `up`), or is history.
    pub last_error_current: bool,
}

/// The health bookkeeping behind [`L2Health`].
#[derive(Debug, Default)]
struct HealthState {
    probe_ok: bool,
    last_error: Option<String>,
    /// When `last_error` last happened.
    last_error_at: Option<Instant>,
    /// When a request last succeeded.
    last_ok: Option<Instant>,
    /// When a request last failed.
    last_failed: Option<Instant>,
    /// Lookups skip L2 until then, after one that got nothing but errors or the deadline.
    skip_until: Option<Instant>,
}

/// How long a request's success or failure colours the state the probe gives.
const DEGRADED_WINDOW: Duration = Duration::from_secs(5);
/// How long lookups skip an L2 that failed one completely, before trying it again.
const SKIP_AFTER_FAILURE: Duration = Duration::from_secs(1);

impl HealthState {
    fn report(&self, now: Instant) -> L2Health {
        let recent = |t: Option<Instant>| t.is_some_and(|t| now < t + DEGRADED_WINDOW);
        let state = match (
            self.probe_ok,
            recent(self.last_ok),
            recent(self.last_failed),
        ) {
            (true, _, false) => "up",
            (true, _, true) | (false, true, _) => "degraded",
            (false, false, _) => "down",
        };
        L2Health {
            state,
            last_error: self.last_error.clone(),
            last_error_age_s: self
                .last_error_at
                .map(|t| (now.saturating_duration_since(t).as_secs_f64() * 10.0).round() / 10.0),
            last_error_current: self.last_error.is_some() && state != "up",
        }
    }

    fn should_ask(&self, now: Instant) -> bool {
        self.skip_until.is_none_or(|t| now >= t)
    }

    fn skip(&mut self, now: Instant) {
        self.skip_until = Some(now + SKIP_AFTER_FAILURE);
    }

    fn request_ok(&mut self, now: Instant) {
        self.last_ok = Some(now);
        self.skip_until = None;
    }

    fn request_failed(&mut self, now: Instant, why: &str) {
        self.last_failed = Some(now);
        self.last_error = Some(why.to_string());
        self.last_error_at = Some(now);
    }

    /// Records a probe; true when it changes the verdict (or is the first failure).
    fn probe(&mut self, now: Instant, ok: bool, why: Option<&str>) -> bool {
        let changed = self.probe_ok != ok || (!ok && self.last_error.is_none());
        self.probe_ok = ok;
        if ok {
            // An answering L2 is worth asking again at once.
            self.skip_until = None;
        }
        if let Some(why) = why {
            self.last_error = Some(why.to_string());
            self.last_error_at = Some(now);
        }
        changed
    }
}

/// How often the health probe runs.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// A chunk waiting to be written behind.
#[derive(Debug, Clone, Copy)]
pub struct WriteItem {
    /// Its key.
    pub key: Key,
    /// Its region's layout digest.
    pub digest: u64,
}

/// The L2 tier: the store, its write-behind queue, health and metrics.
#[derive(Debug)]
pub struct L2Tier {
    /// Settings.
    pub config: L2Config,
    /// The store.
    pub store: Arc<dyn L2Store>,
    /// Counters.
    pub metrics: L2Metrics,
    /// Seals and checks values (with `--l2-secret-file`: a keyed MAC).
    pub codec: value::Codec,
    queue: mpsc::Sender<WriteItem>,
    health: Mutex<HealthState>,
    queue_rx: Mutex<Option<mpsc::Receiver<WriteItem>>>,
}

impl L2Tier {
    /// A tier over `store`; call [`L2Tier::start`] to run its write-behind and health tasks.
    pub fn new(config: L2Config, store: Arc<dyn L2Store>, metrics: L2Metrics) -> L2Tier {
        let (tx, rx) = mpsc::channel(config.queue_chunks);
        metrics.up.set(0);
        L2Tier {
            codec: value::Codec::new(config.mac_key.clone()),
            config,
            store,
            metrics,
            queue: tx,
            health: Mutex::new(HealthState::default()),
            queue_rx: Mutex::new(Some(rx)),
        }
    }

    /// Starts the write-behind task and the health probe, both ending with `stop`.
    pub fn start(self: &Arc<Self>, l1: Arc<L1>, stop: CancellationToken, tracker: &TaskTracker) {
        if let Some(rx) = self.queue_rx.lock().take() {
            tracker.spawn(write::run(self.clone(), l1, rx, stop.clone()));
        }
        let tier = self.clone();
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(PROBE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let probe = tokio::time::timeout(PROBE_EVERY, tier.store.ping()).await;
                match probe {
                    Ok(Ok(())) => tier.probe_ok(),
                    Ok(Err(e)) => tier.probe_failed(&e.to_string()),
                    Err(_) => tier.probe_failed(&format!(
                        "PING unanswered within {} ms",
                        PROBE_EVERY.as_millis()
                    )),
                }
            }
        });
    }

    /// The health state now.
    pub fn health(&self) -> L2Health {
        self.health.lock().report(Instant::now())
    }

    /// Whether a lookup should ask L2: not for a second after one got nothing from it.
    pub fn should_ask(&self) -> bool {
        self.health.lock().should_ask(Instant::now())
    }

    /// Lets lookups skip L2 for a while: the last one got only errors or missed the deadline.
    fn skip_for_a_while(&self) {
        self.health.lock().skip(Instant::now());
    }

    /// Notes that a request succeeded.
    fn note_ok(&self) {
        self.health.lock().request_ok(Instant::now());
    }

    fn probe_ok(&self) {
        if self.health.lock().probe(Instant::now(), true, None) {
            tracing::info!("L2 {} answers", self.config.url);
        }
        self.metrics.up.set(1);
    }

    /// Records a failed probe; logged once per transition.
    fn probe_failed(&self, why: &str) {
        if self.health.lock().probe(Instant::now(), false, Some(why)) {
            tracing::warn!(
                "L2 {} does not answer ({why}); kvd serves from L1, and from L2 where it can, \
                 until it does — check the servers and --l2",
                self.config.url
            );
        }
        self.metrics.up.set(0);
    }

    /// Notes an operation's error: counted, and remembered for `/healthz`.
    fn note_error(&self, e: &L2Error) {
        self.metrics
            .errors
            .with_label_values(&[e.op(), e.kind()])
            .inc();
        self.health
            .lock()
            .request_failed(Instant::now(), &e.to_string());
    }

    /// Queues stored chunks for writing behind; a full queue drops them, counted.
    pub fn write_behind(&self, items: impl IntoIterator<Item = WriteItem>) {
        for item in items {
            match self.queue.try_send(item) {
                Ok(()) => self.metrics.queued.inc(),
                Err(_) => self
                    .metrics
                    .write_behind
                    .with_label_values(&["dropped_queue_full"])
                    .inc(),
            }
        }
    }
}

impl Tier for L2Tier {
    /// The lookup waits for L2's round trip (up to `--l2-deadline-ms`): what it fetches is
    /// written into L1 before the lookup reports it.
    fn fill(
        self: Arc<Self>,
        l1: &Arc<L1>,
        regs: &Arc<dyn Registrations>,
        l: &Arc<Lookup>,
        above: &[Arc<dyn Tier>],
    ) -> Fill {
        let (l1, regs, l, above) = (l1.clone(), regs.clone(), l.clone(), above.to_vec());
        Fill::Later(Box::pin(async move {
            fill::fill(&l1, &*regs, &self, &l, &above).await;
        }))
    }

    /// Written behind, once their copy into L1 is complete.
    fn stored(&self, keys: &[Key], digest: u64) {
        self.write_behind(keys.iter().map(|&key| WriteItem { key, digest }));
    }
}

/// Connects the configured L2, if any: the adapter is created at once (a bad URL fails the
/// start), its connections are made in the background.
pub fn open(
    config: Option<&L2Config>,
    metrics: &crate::ops::metrics::Metrics,
) -> Result<Option<Arc<L2Tier>>, L2Error> {
    let Some(config) = config else {
        return Ok(None);
    };
    let store = redis::RedisStore::connect(config)?;
    if config.password_in_url {
        tracing::warn!(
            "the --l2 URL carries the L2 password, which every local user can read in the \
             process list; put it in --l2-password-file or {} instead",
            secret::PASSWORD_ENV
        );
    }
    tracing::info!(
        "L2: {}{} ({} connections, lookup deadline {} ms, write-behind queue {} chunks, TTL {}, \
         values {})",
        config.url,
        if config.tls { " over TLS" } else { "" },
        config.connections,
        config.deadline.as_millis(),
        config.queue_chunks,
        config
            .ttl
            .map_or("none".to_string(), |t| format!("{} s", t.as_secs())),
        if config.mac_key.is_some() {
            "MAC'd with --l2-secret-file"
        } else {
            "checksummed, not authenticated"
        }
    );
    Ok(Some(Arc::new(L2Tier::new(
        config.clone(),
        Arc::new(store),
        L2Metrics::new(metrics),
    ))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_follows_the_probe_and_recent_requests() {
        let t0 = Instant::now();
        let mut h = HealthState::default();
        assert_eq!(h.report(t0).state, "down", "nothing answered yet");
        h.request_ok(t0);
        assert_eq!(
            h.report(t0).state,
            "degraded",
            "requests succeed, the probe does not"
        );
        assert!(h.probe(t0, true, None));
        assert_eq!(h.report(t0).state, "up");
        assert_eq!(h.report(t0).last_error_age_s, None, "no error yet");
        h.request_failed(t0, "a node refused");
        assert_eq!(h.report(t0).state, "degraded", "a cluster that lost a node");
        assert_eq!(h.report(t0).last_error.as_deref(), Some("a node refused"));
        assert!(h.report(t0).last_error_current);
        let later = h.report(t0 + DEGRADED_WINDOW);
        assert_eq!(later.state, "up");
        assert_eq!(later.last_error.as_deref(), Some("a node refused"));
        assert!(
            !later.last_error_current,
            "an error from before L2 came back is history"
        );
        assert_eq!(later.last_error_age_s, Some(DEGRADED_WINDOW.as_secs_f64()));
        let t1 = t0 + DEGRADED_WINDOW;
        assert!(h.probe(t1, false, Some("refused")));
        assert!(
            !h.probe(t1, false, Some("refused")),
            "logged once per change"
        );
        assert_eq!(h.report(t1).state, "down");
        assert!(h.report(t1).last_error_current);
        assert_eq!(h.report(t1).last_error_age_s, Some(0.0));
    }

    #[test]
    fn a_failed_lookup_makes_the_next_second_skip_l2() {
        let t0 = Instant::now();
        let mut h = HealthState::default();
        assert!(h.should_ask(t0));
        h.skip(t0);
        assert!(!h.should_ask(t0 + SKIP_AFTER_FAILURE / 2));
        assert!(h.should_ask(t0 + SKIP_AFTER_FAILURE));
        h.skip(t0);
        h.probe(t0, true, None);
        assert!(h.should_ask(t0), "an answering probe ends the skip");
        h.skip(t0);
        h.request_ok(t0);
        assert!(h.should_ask(t0), "so does a successful request");
    }
}
