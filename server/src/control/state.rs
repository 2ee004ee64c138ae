//! What every request handler shares: the settings requests are answered with, L1 (through
//! its handle), the devices, sessions, shared descriptors, the tiers below L1, and where the
//! server is in its life.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvd_gpu::PoolLayout;
use parking_lot::Mutex;
use tokio::time::Instant;

use super::fdpass::FdStash;
use super::recall::Recall;
use super::session::Sessions;
use crate::data::devices::Devices;
use crate::l1::L1;
use crate::ops::metrics::Metrics;
use crate::tiers::chain::Tiers;
use crate::tiers::fill::{Registrations, ShardPages};

/// Where the server is in its life.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Binding sockets.
    Starting,
    /// First-touching the pool's first slabs.
    Populating {
        /// Fraction done.
        fraction: f64,
        /// Throughput so far.
        gb_per_s: f64,
    },
    /// Registering the pool's first slabs with the GPU driver.
    Pinning,
    /// Serving (the rest of the pool may still be growing: see [`L1::growth`]).
    Ready,
    /// The pool could not be made.
    Failed(String),
    /// Draining for exit.
    ShuttingDown,
}

/// Unclaimed descriptors are closed after this long.
pub const FD_STASH_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(60);

/// The settings requests are answered with (from `kvd serve`'s flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Tokens per chunk (`--chunk-tokens`).
    pub chunk_tokens: u32,
    /// The fd socket's path, told to clients in the hello reply.
    pub fd_socket: PathBuf,
    /// How long a lookup's pin lasts without its retrieve (`--pin-timeout-ms`).
    pub pin_timeout: Duration,
    /// How long a client may be silent (`--session-timeout-ms`).
    pub session_timeout: Duration,
    /// The largest request frame (`--max-frame-mb`).
    pub max_frame_bytes: usize,
    /// Received, unanswered request bytes across connections (`--max-buffered-mb`).
    pub max_buffered_bytes: usize,
    /// The pool's layout: copies never merge across its pinned pieces.
    pub layout: PoolLayout,
    /// Bytes of remembered prompts kept for warming engines (`--recall-mb`; 0: none).
    pub recall_bytes: usize,
}

/// Everything handlers share.
#[derive(Debug)]
pub struct State {
    /// Settings.
    pub settings: Settings,
    /// Metrics.
    pub metrics: Metrics,
    /// Start time.
    pub started: Instant,
    /// Life phase.
    pub phase: Mutex<Phase>,
    /// L1: the cache, the pool's memory and growth.
    pub l1: Arc<L1>,
    /// Set once the pool's first slabs are ready.
    pub devices: OnceLock<Devices>,
    /// Descriptors received on the fd socket.
    pub fds: Arc<FdStash>,
    /// Sessions and regions.
    pub sessions: Mutex<Sessions>,
    /// The tiers below L1, once started.
    pub tiers: OnceLock<Tiers>,
    /// Prompts remembered for warming replacement engines.
    pub recall: Mutex<Recall>,
}

impl State {
    /// Fresh state over `l1`, taking descriptors into `fds`.
    pub fn new(settings: Settings, metrics: Metrics, l1: Arc<L1>, fds: FdStash) -> Arc<Self> {
        Arc::new(State {
            metrics,
            started: Instant::now(),
            phase: Mutex::new(Phase::Starting),
            l1,
            devices: OnceLock::new(),
            fds: Arc::new(fds),
            sessions: Mutex::new(Sessions::default()),
            tiers: OnceLock::new(),
            recall: Mutex::new(Recall::new(settings.recall_bytes)),
            settings,
        })
    }

    /// Sets the phase.
    pub fn set_phase(&self, phase: Phase) {
        *self.phase.lock() = phase;
    }

    /// Whether the pool is still growing and kvd is not exiting: a store that finds no free
    /// page may wait for the next step.
    pub fn pool_growing(&self) -> bool {
        self.l1.growth().state() == "growing" && self.phase() != Phase::ShuttingDown
    }

    /// The phase now.
    pub fn phase(&self) -> Phase {
        self.phase.lock().clone()
    }

    /// Brings the pool and session gauges up to date.
    pub fn refresh_metrics(&self) {
        let stats = self.l1.cache().stats();
        self.metrics.observe_cache(&stats);
        let sessions = self.sessions.lock();
        self.metrics.sessions.set(sessions.session_count() as i64);
        self.metrics
            .registered_workers
            .set(sessions.region_count() as i64);
    }
}

impl Registrations for State {
    fn pages(&self, fingerprint: u64, shards: &[u32]) -> Option<Vec<ShardPages>> {
        let sessions = self.sessions.lock();
        shards
            .iter()
            .map(|&shard| Some((shard, sessions.placement(fingerprint, shard)?)))
            .collect()
    }
}
