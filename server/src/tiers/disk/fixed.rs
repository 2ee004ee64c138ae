//! The L1 pool as io_uring fixed buffers for the disk tier's two rings (`kvd-disk-read`'s
//! [`kvd_uring::Ring`], `kvd-disk-write`'s [`kvd_uring::WriteQueue`]): a value read straight
//! into its L1 page, or written straight from it, then names a registered buffer
//! (`ReadFixed`/`WriteFixed`) and the kernel does not pin and unpin the page's memory for every
//! I/O — the "O_DIRECT on registered buffers, the pinned pool itself".
//!
//! Each ring registers the pool in 1 GiB pieces (the kernel's limit per buffer) as the pool
//! becomes ready — registering pins, so populates, every page, and the pool is first-touched
//! by its own threads (NUMA, hugepages) while kvd serves — at most [`STEP_BYTES`] per call, so
//! a lookup never waits for a large pool to be pinned. Headers and bounce buffers stay plain.
//! Where registration fails (a kernel before 5.19, `RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`),
//! the log says so once and the ring keeps plain reads and writes, which move the same bytes.
//! `kvd_disk_ios_total{direction, buffer}` counts which opcode each I/O used, and
//! `kvd_disk_fixed_buffer_bytes{ring}` how much of the pool each ring has registered.
//!
//! Registered pages are long-term pinned, as a GPU driver's registration pins them: kvd must
//! not `fork` while it serves (a child would get eager copies of every pinned page), and does
//! not; on Linux 6.18 (the dev VM) the dev-VM measurement found no throughput difference
//! either way (benches/results/2026-12-02-disk-dev-vm.md, "The pool as io_uring fixed buffers").

use std::sync::Arc;

use kvd_uring::{FixedBuffers, RawBytes, MAX_FIXED_PIECE_BYTES};

use super::DiskTier;
use crate::l1::L1;

/// Most bytes of the pool one call registers (pinning is a few GB/s per thread).
pub(crate) const STEP_BYTES: usize = 4 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// No pool yet (no device registered), or none of it registered yet.
    Waiting,
    /// A table is set up; pieces are registered as the pool grows.
    On,
    /// Registration failed: plain opcodes from now on.
    Off,
}

/// One ring's registration of the pool.
#[derive(Debug)]
pub(crate) struct FixedPool {
    /// `read` or `write`: the ring, and the direction of its I/Os in the metrics.
    direction: &'static str,
    phase: Phase,
    logged_full: bool,
}

impl FixedPool {
    /// Nothing registered yet, for the ring whose I/Os go in `direction` (`read`, `write`).
    pub(crate) fn new(direction: &'static str) -> FixedPool {
        FixedPool {
            direction,
            phase: Phase::Waiting,
            logged_full: false,
        }
    }

    /// Registers the pool's ready part with `ring`, up to [`STEP_BYTES`] more than before.
    pub(crate) fn refresh(&mut self, tier: &DiskTier, l1: &L1, ring: &mut impl FixedBuffers) {
        if self.phase == Phase::Off {
            return;
        }
        let Some(pool) = l1.memory().cloned() else {
            return;
        };
        let total = pool.size_bytes() as usize;
        if self.phase == Phase::Waiting {
            let mem: Arc<dyn RawBytes + Send> = pool.clone();
            if let Err(e) = ring.register_fixed(mem, MAX_FIXED_PIECE_BYTES) {
                return self.off(&e);
            }
            self.phase = Phase::On;
        }
        let before = ring.fixed_bytes();
        let ready = (pool.ready_bytes() as usize).min(before.saturating_add(STEP_BYTES));
        match ring.extend_fixed(ready) {
            Ok(now) if now > before => {
                tier.metrics
                    .fixed_bytes
                    .with_label_values(&[self.direction])
                    .set(now as i64);
                if before == 0 {
                    tracing::info!(
                        "disk tier: the pool is registered with the {} ring as io_uring fixed \
                         buffers as it becomes ready ({:.2} of {:.2} GiB so far): {}s into L1 \
                         pages use {}",
                        self.direction,
                        now as f64 / (1u64 << 30) as f64,
                        total as f64 / (1u64 << 30) as f64,
                        self.direction,
                        if self.direction == "read" {
                            "ReadFixed"
                        } else {
                            "WriteFixed"
                        }
                    );
                }
                if now >= total && !self.logged_full {
                    self.logged_full = true;
                    tracing::info!(
                        "disk tier: all {:.2} GiB of the pool registered with the {} ring",
                        total as f64 / (1u64 << 30) as f64,
                        self.direction
                    );
                }
            }
            Ok(_) => {}
            Err(e) => self.off(&e),
        }
    }

    fn off(&mut self, e: &std::io::Error) {
        self.phase = Phase::Off;
        tracing::warn!(
            "disk tier: the pool could not be registered with the {} ring as io_uring fixed \
             buffers ({e}); its I/Os stay plain (the kernel pins each one's pages) — a kernel \
             before 5.19, or RLIMIT_MEMLOCK too low without CAP_IPC_LOCK",
            self.direction
        );
    }

    /// Counts the ring's I/Os since the last call by opcode kind.
    pub(crate) fn count(&self, tier: &DiskTier, ring: &mut impl FixedBuffers) {
        let c = ring.take_op_counts();
        let ios = &tier.metrics.ios;
        ios.with_label_values(&[self.direction, "fixed"])
            .inc_by(c.fixed);
        ios.with_label_values(&[self.direction, "plain"])
            .inc_by(c.plain);
    }
}
