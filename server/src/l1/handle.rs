//! The one handle to L1 that the rest of kvd holds: the cache behind its lock, the pool's
//! memory once its first slabs are ready, where NUMA placed them, and how far the pool has
//! grown. The control plane, the tiers below L1 and the pool's growth all go through it; none of
//! them reaches into another part's state for L1's.
//!
//! The lock is held only for the few microseconds a cache operation takes; nothing waits,
//! copies or does I/O under it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvd_gpu::PoolMemory;
use parking_lot::{Mutex, MutexGuard};
use tokio::sync::watch;

use super::cache::Cache;
use super::numa::Placement;

/// How far the pool has grown, for `/healthz` and logs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Growth {
    /// Bytes populated, pinned and handed to the allocator.
    pub ready_bytes: u64,
    /// Bytes of the whole pool.
    pub total_bytes: u64,
    /// Ready bytes per second since growth began, in GB/s (10^9 bytes).
    pub gb_per_s: f64,
    /// Time from start to a full pool, once it is full.
    pub full_after: Option<Duration>,
    /// Why the pool stopped growing, if it did.
    pub error: Option<String>,
}

impl Growth {
    /// `growing`, `full` or `stopped` (an error ended the growth).
    pub fn state(&self) -> &'static str {
        if self.error.is_some() {
            "stopped"
        } else if self.ready_bytes >= self.total_bytes && self.total_bytes > 0 {
            "full"
        } else {
            "growing"
        }
    }
}

/// L1: the cache over the pool, the pool's bytes, and its growth.
#[derive(Debug)]
pub struct L1 {
    cache: Mutex<Cache>,
    /// Set once the pool's first slabs are ready.
    memory: OnceLock<Arc<PoolMemory>>,
    /// Which NUMA node backs which slabs; `None` on a one-node machine.
    placement: Option<Placement>,
    growth: Mutex<Growth>,
    /// Bytes of the pool ready so far; also touched when the growth ends, so that stores
    /// waiting for it look again.
    grown: watch::Sender<u64>,
    /// Set when a store waited for growth in vain; cleared by the next growth step.
    lagging: AtomicBool,
}

impl L1 {
    /// L1 over `cache` (whose pool grows from no slabs), with the pool's NUMA `placement`.
    pub fn new(cache: Cache, placement: Option<Placement>) -> Arc<L1> {
        let growth = Growth {
            total_bytes: cache.stats().total_bytes,
            ..Growth::default()
        };
        Arc::new(L1 {
            cache: Mutex::new(cache),
            memory: OnceLock::new(),
            placement,
            growth: Mutex::new(growth),
            grown: watch::Sender::new(0),
            lagging: AtomicBool::new(false),
        })
    }

    /// The cache, locked: index, pins, holds, eviction, the removal feed.
    pub fn cache(&self) -> MutexGuard<'_, Cache> {
        self.cache.lock()
    }

    /// The pool's memory, once its first slabs are ready.
    pub fn memory(&self) -> Option<&Arc<PoolMemory>> {
        self.memory.get()
    }

    /// Records the pool's memory when its first slabs are ready.
    pub fn set_memory(&self, memory: Arc<PoolMemory>) {
        let _ = self.memory.set(memory);
    }

    /// Where NUMA placed the pool's slabs; `None` on a one-node machine.
    pub fn placement(&self) -> Option<&Placement> {
        self.placement.as_ref()
    }

    /// How far the pool has grown.
    pub fn growth(&self) -> Growth {
        self.growth.lock().clone()
    }

    /// Changes the growth record.
    pub fn update_growth(&self, f: impl FnOnce(&mut Growth)) {
        f(&mut self.growth.lock());
    }

    /// Hands the slabs `0..slabs`, `ready_bytes` of the pool, to the allocator and wakes the
    /// stores waiting for them.
    pub fn grow_to(&self, slabs: u32, ready_bytes: u64) {
        self.cache.lock().grow_pool(slabs);
        self.lagging.store(false, Ordering::Relaxed);
        self.grown.send_replace(ready_bytes);
    }

    /// Wakes the stores waiting for growth: the growth has ended.
    pub fn growth_ended(&self) {
        self.grown.send_modify(|_| {});
    }

    /// A receiver that changes with each growth step and when the growth ends.
    pub fn watch_growth(&self) -> watch::Receiver<u64> {
        self.grown.subscribe()
    }

    /// Whether a store waited for growth in vain since the last step: stores then evict as in
    /// a full pool rather than wait.
    pub fn lagging(&self) -> bool {
        self.lagging.load(Ordering::Relaxed)
    }

    /// Notes that a store waited for growth in vain.
    pub fn set_lagging(&self) {
        self.lagging.store(true, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_state_names_the_phase() {
        let mut g = Growth {
            ready_bytes: 1,
            total_bytes: 4,
            ..Growth::default()
        };
        assert_eq!(g.state(), "growing");
        g.ready_bytes = 4;
        assert_eq!(g.state(), "full");
        g.error = Some("memlock".into());
        assert_eq!(g.state(), "stopped");
    }
}
