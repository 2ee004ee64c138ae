//! The server's shared state, and its readiness as `/healthz` reports it.

use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::control::fdpass::FdStash;
use crate::control::session::Sessions;
use crate::data::devices::Devices;
use crate::l1::cache::Cache;
use crate::l1::evict::PolicyKind;
use crate::l1::numa::Placement;
use crate::l1::pool::PagePool;
use crate::life::config::{Config, NumaMode};
use crate::life::grow::Growth;
use crate::ops::metrics::Metrics;
use crate::tiers::l2::L2Tier;

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
    /// Serving (the rest of the pool may still be growing: see [`State::growth`]).
    Ready,
    /// The pool could not be made.
    Failed(String),
    /// Draining for exit.
    ShuttingDown,
}

/// Unclaimed descriptors are closed after this long.
pub const FD_STASH_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(60);

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
    /// Set once the pool's first slabs are ready.
    pub devices: OnceLock<Devices>,
    /// How far the pool has grown.
    pub growth: Mutex<Growth>,
    /// Which NUMA node backs which slabs; `None` on a one-node machine.
    pub placement: Option<Placement>,
    /// Descriptors received on the fd socket.
    pub fds: Arc<FdStash>,
    /// Sessions and regions.
    pub sessions: Mutex<Sessions>,
    /// The L2 tier, when `--l2` names one.
    pub tier: OnceLock<Arc<L2Tier>>,
    /// Bytes of the pool ready so far; also touched when the growth ends, so that stores
    /// waiting for it (see `handler::transfer`) look again.
    pub grown: tokio::sync::watch::Sender<u64>,
    /// Set when a store waited for growth in vain; cleared by the next growth step.
    pub growth_lagging: std::sync::atomic::AtomicBool,
    /// The disk tier, when `--disk` names one.
    pub disk: OnceLock<Arc<crate::tiers::disk::DiskTier>>,
}

impl State {
    /// Fresh state for `config`.
    pub fn new(config: Config, metrics: Metrics) -> Arc<Self> {
        // Slabs join the allocator as the pool grows (see `grow`).
        let mut pool = PagePool::growing(&config.layout);
        let placement = match config.numa {
            NumaMode::Off => None,
            NumaMode::Auto | NumaMode::Remote => Placement::new(&config.layout, &config.topology),
        };
        if let Some(p) = &placement {
            pool.set_homes(p.homes(), |slab| p.home_of_piece(slab));
        }
        let kind: PolicyKind = config.eviction;
        metrics.pool_bytes.set(pool.total_bytes() as i64);
        let fds = Arc::new(FdStash::new(
            config.fd_limits.max_stashed,
            config.fd_limits.max_stashed_per_uid,
            config.fd_limits.own_uid,
        ));
        let growth = Growth {
            total_bytes: pool.total_bytes(),
            ..Growth::default()
        };
        Arc::new(State {
            cache: Mutex::new(
                Cache::new(pool, kind)
                    .with_feed_capacity(config.events_capacity)
                    .with_lookup_pin_frac(config.lookup_pin_frac)
                    .with_lookup_holds(config.lookup_hold_frac, config.lookup_hold),
            ),
            config,
            metrics,
            started: Instant::now(),
            phase: Mutex::new(Phase::Starting),
            devices: OnceLock::new(),
            growth: Mutex::new(growth),
            placement,
            fds,
            sessions: Mutex::new(Sessions::default()),
            tier: OnceLock::new(),
            grown: tokio::sync::watch::Sender::new(0),
            growth_lagging: std::sync::atomic::AtomicBool::new(false),
            disk: OnceLock::new(),
        })
    }

    /// Sets the phase.
    pub fn set_phase(&self, phase: Phase) {
        *self.phase.lock() = phase;
    }

    /// Whether the pool is still growing and kvd is not exiting: a store that finds no free
    /// page may wait for the next step.
    pub fn pool_growing(&self) -> bool {
        self.growth.lock().state() == "growing" && self.phase() != Phase::ShuttingDown
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
