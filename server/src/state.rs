//! The server's shared state, and its readiness as `/healthz` reports it.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::cache::Cache;
use crate::config::Config;
use crate::devices::Devices;
use crate::evict::PolicyKind;
use crate::fdpass::FdStash;
use crate::metrics::Metrics;
use crate::pool::PagePool;
use crate::session::Sessions;
use crate::tier::Tier;

/// Where the server is in its life.
#[derive(Debug, Clone, PartialEq)]
pub enum Phase {
    /// Binding sockets.
    Starting,
    /// First-touching the pool.
    Populating {
        /// Fraction done.
        fraction: f64,
        /// Throughput so far.
        gb_per_s: f64,
    },
    /// Registering the pool with the GPU driver.
    Pinning,
    /// Serving.
    Ready,
    /// The pool could not be made.
    Failed(String),
    /// Draining for exit.
    ShuttingDown,
}

/// Unclaimed descriptors are closed after this long.
pub const FD_STASH_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(60);
/// Most unclaimed descriptors held at once.
pub const FD_STASH_MAX_FDS: usize = 65_536;

/// Everything handlers share.
#[derive(Debug)]
pub struct State {
    /// Settings.
    pub config: Config,
    /// Metrics.
    pub metrics: Metrics,
    /// Start time.
    pub started: Instant,
    /// Life phase.
    pub phase: Mutex<Phase>,
    /// Index, pins, eviction.
    pub cache: Mutex<Cache>,
    /// Set once the pool is ready.
    pub devices: OnceLock<Devices>,
    /// Descriptors received on the fd socket.
    pub fds: Arc<FdStash>,
    /// Sessions and regions.
    pub sessions: Mutex<Sessions>,
    /// The L2 tier, when `--l2` names one.
    pub tier: OnceLock<Arc<Tier>>,
}

impl State {
    /// Fresh state for `config`.
    pub fn new(config: Config, metrics: Metrics) -> Arc<Self> {
        let pool = PagePool::new(config.pool_bytes, config.slab_bytes);
        let kind: PolicyKind = config.eviction;
        metrics.pool_bytes.set(pool.capacity_bytes() as i64);
        Arc::new(State {
            cache: Mutex::new(Cache::new(pool, kind)),
            config,
            metrics,
            started: Instant::now(),
            phase: Mutex::new(Phase::Starting),
            devices: OnceLock::new(),
            fds: Arc::new(FdStash::new(FD_STASH_MAX_FDS)),
            sessions: Mutex::new(Sessions::default()),
            tier: OnceLock::new(),
        })
    }

    /// Sets the phase.
    pub fn set_phase(&self, phase: Phase) {
        *self.phase.lock() = phase;
    }

    /// The phase now.
    pub fn phase(&self) -> Phase {
        self.phase.lock().clone()
    }

    /// Brings the pool and session gauges up to date.
    pub fn refresh_metrics(&self) {
        let stats = self.cache.lock().stats();
        self.metrics.observe_cache(&stats);
        let sessions = self.sessions.lock();
        self.metrics.sessions.set(sessions.session_count() as i64);
        self.metrics
            .registered_workers
            .set(sessions.region_count() as i64);
    }
}
