//! Making the L1 pool ready in the background, so kvd serves within a second at any pool size.
//!
//! Populating and pinning a whole pool before serving took 27.8 s for 180 GiB on an H200 host,
//! and the recipes use 1.5–3 TB. Instead the pool is mapped once and made ready in steps of
//! whole pieces, lowest first: first-touch the step's range on `--populate-threads` threads,
//! pin it (where a GPU driver is present), then mark it ready in the mapping (copies refuse any
//! byte beyond that mark) and hand its slabs to the page allocator (which gives out pages only
//! from slabs handed over). The first step is one piece, so the first store can land within a
//! second; steps then double up to about a gigabyte per populating thread, so later steps cost
//! few driver calls and the growth stays close to the speed of one pass over the whole pool.
//!
//! If the first step fails kvd cannot serve and exits with the reason; if a later one fails
//! (the memlock limit, say) kvd keeps serving from what is ready and `/healthz` names the
//! error.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_gpu::{GpuBackend, PoolMemory, PoolPin};
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::config::Config;
use crate::control::state::{Phase, State};
use crate::data::devices::Devices;
use crate::l1::numa::NumaMode;

/// Bytes one populating thread touches per step once the growth is under way.
const STEP_BYTES_PER_THREAD: u64 = 1 << 30;
/// How often first-touch progress is reported.
const REPORT_EVERY: Duration = Duration::from_millis(200);
/// How often growth progress is logged.
const LOG_EVERY: Duration = Duration::from_secs(3);

/// The steps that make `pieces` pieces ready, in order: one piece, then doubling up to
/// `max_step_pieces` pieces a step.
pub fn plan_steps(pieces: u32, max_step_pieces: u32) -> Vec<Range<u32>> {
    let max_step = max_step_pieces.max(1);
    let mut steps = Vec::new();
    let (mut at, mut step) = (0u32, 1u32);
    while at < pieces {
        let end = at.saturating_add(step).min(pieces);
        steps.push(at..end);
        at = end;
        step = step.saturating_mul(2).min(max_step);
    }
    steps
}

/// Largest step, in pieces, for `threads` populating threads.
pub fn max_step_pieces(piece_bytes: u64, threads: usize) -> u32 {
    let bytes = STEP_BYTES_PER_THREAD.saturating_mul(threads.max(1) as u64);
    u32::try_from(bytes / piece_bytes.max(1))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// Maps the pool and grows it step by step until it is full, `stop` is cancelled or a step
/// fails. Runs on a blocking thread. Sends the reason on `fatal` when not even the first step
/// could be made ready; keeps each pin in `pins` for the server to drop at exit.
pub fn grow(
    state: &Arc<State>,
    config: &Config,
    gpu: Result<GpuBackend, String>,
    stop: &CancellationToken,
    pins: &Mutex<Vec<PoolPin>>,
    fatal: oneshot::Sender<String>,
) {
    let c = config;
    let l1 = &state.l1;
    let layout = c.layout;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    // However the growth ends, stores waiting for it look again (and are answered).
    let _wake = WakeOnEnd(state);
    tracing::info!(
        "L1 pool: {:.2} GiB ({}), slabs of {} MiB, {} populate threads",
        gib(layout.size_bytes()),
        c.size_rule,
        layout.piece_bytes() >> 20,
        c.populate_threads
    );
    let memory = match PoolMemory::allocate(layout, c.hugepages) {
        Ok(m) => Arc::new(m),
        Err(e) => return fail_start(state, fatal, &e.to_string()),
    };
    if let Some(p) = l1.placement() {
        let mut placed = vec![0u64; p.homes() as usize];
        for (node, pieces) in p.groups() {
            let bytes = layout.pieces_range(pieces.clone());
            match memory.prefer_node(bytes.clone(), node) {
                Ok(()) => placed[p.home_of_piece(pieces.start) as usize] += bytes.end - bytes.start,
                // Placement only speeds copies up; the pool works without it.
                Err(e) => tracing::warn!("{e}; those bytes go wherever the kernel puts them"),
            }
        }
        for (home, bytes) in placed.iter().enumerate() {
            tracing::info!(
                "NUMA node {} backs {:.1} GiB of the pool, in groups of {} MiB dealt in turn",
                p.node_of_home(home as u16),
                gib(*bytes),
                p.groups()
                    .next()
                    .map_or(0, |(_, r)| layout.pieces_range(r).end >> 20)
            );
        }
    }
    if let Err(why) = &gpu {
        tracing::warn!(
            "no GPU driver found ({why}): the pool stays pageable and only host-memory clients \
             can register; to serve vLLM, run kvd where the GPUs and their driver are visible"
        );
    }
    let began = Instant::now();
    let mut last_log = Instant::now();
    let mut fatal = Some(fatal);
    for (i, step) in plan_steps(
        layout.pieces(),
        max_step_pieces(layout.piece_bytes(), c.populate_threads),
    )
    .into_iter()
    .enumerate()
    {
        if stop.is_cancelled() {
            tracing::info!(
                "stopped growing the pool at {:.1} of {:.1} GiB: kvd is exiting",
                gib(memory.ready_bytes()),
                gib(layout.size_bytes())
            );
            return;
        }
        let first = i == 0;
        let bytes = layout.pieces_range(step.clone());
        if first {
            state.set_phase(Phase::Populating {
                fraction: 0.0,
                gb_per_s: 0.0,
            });
        }
        memory.first_touch_range(bytes.clone(), c.populate_threads, REPORT_EVERY, &mut |p| {
            if first {
                state.set_phase(Phase::Populating {
                    fraction: p.fraction(),
                    gb_per_s: p.gb_per_s(),
                });
            }
        });
        if let Ok(gpu) = &gpu {
            if first {
                state.set_phase(Phase::Pinning);
            }
            match gpu.pin_pool(&memory, step.clone()) {
                Ok(pin) => pins.lock().push(pin),
                Err(e) => {
                    let msg = format!(
                        "pinning L1 pool bytes {}..{} for DMA failed: {e}",
                        bytes.start, bytes.end
                    );
                    if let Some(fatal) = fatal.take() {
                        return fail_start(state, fatal, &msg);
                    }
                    return stop_growing(state, &memory, &msg);
                }
            }
            state.metrics.pool_pinned.set(1);
        }
        // Ready in the mapping before the allocator can hand out a page there.
        memory.mark_ready(bytes.end);
        l1.grow_to(step.end, bytes.end);
        state.metrics.pool_ready_bytes.set(bytes.end as i64);
        l1.update_growth(|g| {
            g.ready_bytes = bytes.end;
            g.gb_per_s = bytes.end as f64 / began.elapsed().as_secs_f64().max(1e-9) / 1e9;
        });
        if first {
            fatal = None;
            let devices = Devices::new(
                memory.clone(),
                gpu.clone().ok(),
                c.copy_queue,
                state.metrics.clone(),
            )
            .with_numa(
                c.topology.clone(),
                l1.placement().cloned(),
                c.numa == NumaMode::Remote,
            );
            l1.set_memory(memory.clone());
            let _ = state.devices.set(devices);
            let secs = state.started.elapsed().as_secs_f64();
            state.metrics.pool_ready_seconds.set(secs);
            state.set_phase(Phase::Ready);
            tracing::info!(
                "ready in {secs:.2} s with {:.2} of {:.1} GiB; the rest of the pool grows in the \
                 background",
                gib(bytes.end),
                gib(layout.size_bytes())
            );
        } else if last_log.elapsed() >= LOG_EVERY {
            last_log = Instant::now();
            tracing::info!(
                "L1 pool ready: {:.1} of {:.1} GiB ({:.0}%), {:.1} GB/s",
                gib(bytes.end),
                gib(layout.size_bytes()),
                bytes.end as f64 / layout.size_bytes() as f64 * 100.0,
                l1.growth().gb_per_s
            );
        }
    }
    let full = state.started.elapsed();
    l1.update_growth(|g| g.full_after = Some(full));
    state.metrics.pool_full_seconds.set(full.as_secs_f64());
    tracing::info!(
        "L1 pool full: {:.1} GiB populated{} in {:.2} s from start ({:.1} GB/s, huge pages {})",
        gib(layout.size_bytes()),
        if gpu.is_ok() { " and pinned" } else { "" },
        full.as_secs_f64(),
        l1.growth().gb_per_s,
        if memory.hugepages() { "advised" } else { "off" }
    );
}

/// Wakes the stores waiting for growth when the growth ends.
struct WakeOnEnd<'a>(&'a State);

impl Drop for WakeOnEnd<'_> {
    fn drop(&mut self) {
        self.0.l1.growth_ended();
    }
}

fn fail_start(state: &State, fatal: oneshot::Sender<String>, why: &str) {
    let msg = format!("{why}; pass a smaller --l1-size-gb");
    state.set_phase(Phase::Failed(msg.clone()));
    let _ = fatal.send(msg);
}

fn stop_growing(state: &State, memory: &PoolMemory, why: &str) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let msg = format!(
        "{why}; kvd serves from the {:.1} GiB made ready; pass a smaller --l1-size-gb (or raise \
         the memlock limit) to use the whole pool",
        gib(memory.ready_bytes())
    );
    tracing::error!("{msg}");
    state.l1.update_growth(|g| g.error = Some(msg));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_start_with_one_piece_double_and_tile_the_pool() {
        assert_eq!(
            plan_steps(20, 4),
            vec![0..1, 1..3, 3..7, 7..11, 11..15, 15..19, 19..20]
        );
        assert_eq!(plan_steps(1, 8), vec![0..1]);
        assert!(plan_steps(0, 8).is_empty());
        for (pieces, max) in [(1u32, 1u32), (7, 1), (1000, 64), (5, 0)] {
            let steps = plan_steps(pieces, max);
            assert_eq!(steps[0], 0..1);
            assert_eq!(steps.last().unwrap().end, pieces);
            for w in steps.windows(2) {
                assert_eq!(w[0].end, w[1].start, "steps are contiguous and in order");
            }
            assert!(steps.iter().all(|s| s.len() as u32 <= max.max(1)));
        }
    }

    #[test]
    fn a_step_is_about_a_gigabyte_per_thread() {
        assert_eq!(max_step_pieces(256 << 20, 16), 64);
        assert_eq!(max_step_pieces(256 << 20, 1), 4);
        assert_eq!(max_step_pieces(4 << 30, 1), 1, "at least one piece");
    }
}
