//! How bytes move: a copy is a list of runs between one imported device allocation and the L1
//! pool, in one direction. Runs are built by the server from the KV geometry (which blocks) and
//! the page (where bytes live); this module merges them into as few descriptors as the memory
//! allows, since descriptor count, not bytes, is what limits the copy engines on small blocks
//! (one `cudaMemcpyAsync` per 32 KiB block reached 21% of the PCIe ceiling on an H200, measured
//! before kvd was written).

use crate::layout::PoolLayout;

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Device memory to the pool: a store.
    D2h,
    /// The pool to device memory: a retrieve.
    H2d,
}

/// One contiguous range on both sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyRun {
    /// Index into the job's `memories`.
    pub memory: u16,
    /// Offset inside the imported allocation.
    pub device_offset_bytes: u64,
    /// Offset inside the pool.
    pub pool_offset_bytes: u64,
    /// Bytes to copy.
    pub len_bytes: u64,
}

/// Merges neighbouring runs that are contiguous on both sides, keeping their order.
pub fn coalesce(runs: &mut Vec<CopyRun>) {
    merge(runs, |_, _| true);
}

/// Like [`coalesce`], but never lets a run cross a piece of `layout`: the pool is pinned piece
/// by piece, and the driver refuses a copy that spans two pinned ranges (see [`PoolLayout`]).
pub fn coalesce_within(runs: &mut Vec<CopyRun>, layout: &PoolLayout) {
    merge(runs, |start, len| layout.within_one_piece(start, len));
}

/// Merges contiguous neighbours when `allowed(pool_offset, len)` accepts the merged run.
fn merge(runs: &mut Vec<CopyRun>, allowed: impl Fn(u64, u64) -> bool) {
    let mut out: Vec<CopyRun> = Vec::with_capacity(runs.len());
    for run in runs.drain(..) {
        if run.len_bytes == 0 {
            continue;
        }
        if let Some(last) = out.last_mut() {
            if last.memory == run.memory
                && last.device_offset_bytes + last.len_bytes == run.device_offset_bytes
                && last.pool_offset_bytes + last.len_bytes == run.pool_offset_bytes
                && allowed(last.pool_offset_bytes, last.len_bytes + run.len_bytes)
            {
                last.len_bytes += run.len_bytes;
                continue;
            }
        }
        out.push(run);
    }
    *runs = out;
}

/// Total bytes of a run list.
pub fn total_bytes(runs: &[CopyRun]) -> u64 {
    runs.iter().map(|r| r.len_bytes).sum()
}

/// What a copy engine needs of a job ([`crate::CopyJob`]): which way, what, and which client
/// event to wait on first. The job's imports are passed beside it, already matched to the
/// engine's backend.
#[derive(Debug, Clone, Copy)]
pub struct Transfer<'a> {
    /// Which way the bytes go.
    pub direction: Direction,
    /// What to copy; already coalesced.
    pub runs: &'a [CopyRun],
    /// Client event slot to wait on before copying.
    pub wait_slot: Option<u16>,
}

/// Where a GPU engine's last submission spent its time (the server logs a slow one): checking
/// and gathering the runs, queueing the wait on the client's event, and the copy calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubmitTimes {
    /// Checking every run against its mapping and gathering the descriptors.
    pub checks: std::time::Duration,
    /// Querying the client's event and queueing the stream's wait on it.
    pub event_wait: std::time::Duration,
    /// Copy calls made: batch calls, then one call a run where there is no batch call or the
    /// batch call refused the job (`one_call_a_run`).
    pub calls: u32,
    /// Time in the copy calls, and in the slowest one.
    pub calls_time: std::time::Duration,
    pub slowest_call: std::time::Duration,
    /// The runs were copied one call each (no batch call, or it refused them).
    pub one_call_a_run: bool,
}

impl SubmitTimes {
    /// Counts one copy call that took `took`.
    pub fn call(&mut self, took: std::time::Duration) {
        self.calls += 1;
        self.calls_time += took;
        self.slowest_call = self.slowest_call.max(took);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(d: u64, p: u64, l: u64) -> CopyRun {
        CopyRun {
            memory: 0,
            device_offset_bytes: d,
            pool_offset_bytes: p,
            len_bytes: l,
        }
    }

    #[test]
    fn merges_only_when_both_sides_are_contiguous() {
        let mut runs = vec![
            run(0, 100, 10),
            run(10, 110, 5),
            run(15, 200, 5),
            run(40, 205, 5),
        ];
        coalesce(&mut runs);
        assert_eq!(
            runs,
            vec![run(0, 100, 15), run(15, 200, 5), run(40, 205, 5)]
        );
        let other = CopyRun {
            memory: 1,
            ..run(5, 105, 5)
        };
        let mut runs = vec![run(0, 100, 5), other];
        coalesce(&mut runs);
        assert_eq!(runs.len(), 2, "runs in different allocations never merge");
    }

    #[test]
    fn runs_never_cross_a_boundary() {
        let mut runs = vec![run(0, 0, 8), run(8, 8, 8), run(16, 16, 8), run(24, 24, 8)];
        coalesce_within(&mut runs, &PoolLayout::new(64, 16).unwrap());
        assert_eq!(runs, vec![run(0, 0, 16), run(16, 16, 16)]);
    }

    /// Expands runs into (device byte, pool byte) pairs.
    fn byte_map(runs: &[CopyRun]) -> Vec<(u64, u64)> {
        runs.iter()
            .flat_map(|r| {
                (0..r.len_bytes).map(move |i| (r.device_offset_bytes + i, r.pool_offset_bytes + i))
            })
            .collect()
    }

    proptest! {
        #[test]
        fn coalescing_moves_the_same_bytes(
            raw in proptest::collection::vec((0u64..64, 0u64..64, 0u64..8), 0..40),
            boundary in 1u64..80,
        ) {
            let mut runs: Vec<CopyRun> = raw.iter().map(|&(d, p, l)| run(d, p, l)).collect();
            let before = byte_map(&runs);
            let layout = PoolLayout::new(boundary * 200, boundary).unwrap();
            let crossing_before = runs.iter().filter(|r| r.len_bytes > 0 && r.pool_offset_bytes / boundary != (r.pool_offset_bytes + r.len_bytes - 1) / boundary).count();
            coalesce_within(&mut runs, &layout);
            let crossing_after = runs.iter().filter(|r| r.pool_offset_bytes / boundary != (r.pool_offset_bytes + r.len_bytes - 1) / boundary).count();
            prop_assert!(crossing_after <= crossing_before, "coalescing made a run cross a boundary");
            prop_assert_eq!(byte_map(&runs), before);
            prop_assert!(runs.iter().all(|r| r.len_bytes > 0));
            // Nothing left that could have merged without crossing a boundary.
            for w in runs.windows(2) {
                let end = w[1].pool_offset_bytes + w[1].len_bytes;
                prop_assert!(!(w[0].device_offset_bytes + w[0].len_bytes == w[1].device_offset_bytes
                    && w[0].pool_offset_bytes + w[0].len_bytes == w[1].pool_offset_bytes
                    && w[0].pool_offset_bytes / boundary == (end - 1) / boundary));
            }
        }
    }
}
