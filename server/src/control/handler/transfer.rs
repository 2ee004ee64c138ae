//! Stores and retrieves: plan the copy against the cache on the connection's own task, hand it
//! to the device's copy worker, and let the worker's threads answer. A request whose client
//! gave an event is answered the moment the device has taken the copy (the reply names kvd's
//! event for the client to poll); one without is answered once the copy is done. The cache is
//! settled when the copy completes, on the worker's completion thread.
//!
//! A store that finds no free page while the pool is still growing (a burst of stores right
//! after `/healthz` turned 200, when only the first slabs are ready) neither evicts what was
//! just stored nor is refused: its pages are given back and it is planned again after each
//! growth step, for at most [`GROWTH_WAIT`]. Once a wait runs out, growth is not keeping up
//! with the stores: until the next step, stores evict as they do in a full pool (and are
//! refused only when nothing can be evicted), so a slow late step never stalls every store.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::task::TaskTracker;

use kvd_gpu::copy::total_bytes;
use kvd_gpu::{CopyJob, CopyRun, Direction, GpuError};

use crate::control::error::RequestError;
use crate::control::router::PeerId;
use crate::control::session::Region;
use crate::control::state::State;
use crate::data::copier::{CopyListener, Deadline, SubmitError};
use crate::l1::cache::{Key, StorePlan};
use crate::wire::*;

use super::{region_for, ReplyTo};

/// Checks each chunk's blocks against the region's geometry (the chunk count was checked with
/// the request limits, in [`super::dispatch`]).
fn check_chunks(
    region: &Region,
    chunks: &[ChunkBlocks],
    allow_skip: bool,
) -> Result<(), RequestError> {
    for (i, c) in chunks.iter().enumerate() {
        region
            .geometry
            .check_blocks(&c.blocks, allow_skip)
            .map_err(|e| RequestError::Invalid(format!("chunk {i}: {e}")))?;
    }
    Ok(())
}

/// A store's or retrieve's prologue: resolves the region, checks the chunks (`allow_skip`: a
/// retrieve may leave blocks untouched) and the wait slot, and keys the chunks for the cache.
fn prepare(
    state: &State,
    peer: PeerId,
    region: u32,
    salt: u64,
    chunks: &[ChunkBlocks],
    allow_skip: bool,
    wait_slot: Option<u16>,
) -> Result<(Arc<Region>, Vec<Key>), RequestError> {
    let region = region_for(state, peer, region)?;
    check_chunks(&region, chunks, allow_skip)?;
    if wait_slot.is_some() && !region.imports.has_events() {
        return Err(RequestError::Invalid(
            "wait_slot given but this registration has no events".into(),
        ));
    }
    let keys = chunks
        .iter()
        .map(|c| Key {
            fingerprint: region.fingerprint,
            salt,
            shard: region.shard,
            hash: c.hash,
        })
        .collect();
    Ok((region, keys))
}

/// How long a store that found no free page waits for the growing pool.
pub const GROWTH_WAIT: Duration = Duration::from_secs(2);
/// What a store with a deadline keeps of it for its copy: it waits for the growing pool only
/// until this long before its deadline, then evicts as in a full pool rather than expire.
const DEADLINE_MARGIN: Duration = Duration::from_millis(200);

/// Which of a store's chunks the disk tier holds (none without one). Those L1 lacks are not
/// written into L1 again: on the agentic replay (session 26) such rewrites of chunks vLLM's
/// prefix cache still held crowded L1's own chunks out, doubling its evictions and taking its
/// hit rate under the no-disk run's.
fn held_on_disk(state: &State, keys: &[Key]) -> Vec<bool> {
    match state.tiers.get().and_then(|t| t.disk.as_ref()) {
        Some(disk) => disk.holds_keys(keys),
        None => Vec::new(),
    }
}

/// Stores chunks; answered here when nothing needs copying, else by the copy worker (or, while
/// the pool grows and has no page free, after the growth gave it one).
pub fn store(state: &Arc<State>, tasks: &TaskTracker, to: ReplyTo, s: Store) {
    let wait = match Deadline::from_wire(s.deadline_ns) {
        Some(d) => GROWTH_WAIT.min(d.remaining().saturating_sub(DEADLINE_MARGIN)),
        None => GROWTH_WAIT,
    };
    store_within(state, tasks, to, s, Instant::now() + wait);
}

fn store_within(state: &Arc<State>, tasks: &TaskTracker, to: ReplyTo, s: Store, until: Instant) {
    let (region, keys) = match prepare(
        state,
        to.peer,
        s.region,
        s.salt,
        &s.chunks,
        false,
        s.wait_slot,
    ) {
        Ok(x) => x,
        Err(e) => return to.send(Err(e)),
    };
    // Subscribed before planning, so that a step made meanwhile is not missed.
    let mut grown = state.l1.watch_growth();
    let may_wait = Instant::now() < until && state.pool_growing() && !state.l1.lagging();
    let below = held_on_disk(state, &keys);
    let plans =
        state
            .l1
            .cache()
            .begin_store_above(region.class, &keys, region.home, !may_wait, &below);
    if plans.contains(&StorePlan::Refused) && may_wait {
        let taken: Vec<_> = plans
            .iter()
            .filter_map(|p| match p {
                StorePlan::Write { entry, .. } => Some(*entry),
                _ => None,
            })
            .collect();
        let refused = plans
            .iter()
            .filter(|p| matches!(p, StorePlan::Refused | StorePlan::Skipped))
            .count();
        {
            let mut cache = state.l1.cache();
            cache.finish_store(&taken, false);
            cache.forget_refusals(refused as u64);
        }
        let (state, again) = (state.clone(), tasks.clone());
        tasks.spawn(async move {
            if tokio::time::timeout_at(until, grown.changed())
                .await
                .is_err()
            {
                state.l1.set_lagging();
            }
            store_within(&state, &again, to, s, until);
        });
        return;
    }
    let mut runs = Vec::new();
    let mut writing = Vec::new();
    let mut written_keys = Vec::new();
    let mut outcomes = Vec::with_capacity(plans.len());
    for ((plan, chunk), key) in plans.iter().zip(&s.chunks).zip(&keys) {
        outcomes.push(match plan {
            StorePlan::Write { entry, offset } => {
                region.geometry.push_runs(&chunk.blocks, *offset, &mut runs);
                writing.push(*entry);
                written_keys.push(*key);
                StoreOutcome::Stored
            }
            StorePlan::Present => StoreOutcome::AlreadyStored,
            StorePlan::Refused => StoreOutcome::RefusedPoolFull,
            StorePlan::Skipped => StoreOutcome::Skipped,
        });
    }
    for o in &outcomes {
        let label = match o {
            StoreOutcome::Stored => "stored",
            StoreOutcome::AlreadyStored => "already_stored",
            StoreOutcome::RefusedPoolFull => "refused_pool_full",
            StoreOutcome::Skipped => "skipped",
        };
        state.metrics.store_chunks.with_label_values(&[label]).inc();
    }
    if writing.is_empty() {
        return to.send(Ok(Reply::Store(StoreReply {
            outcomes,
            done_slot: None,
        })));
    }
    let region_id = region.id;
    let digest = region.geometry.digest();
    let settle = move |state: &State, end: CopyEnd| {
        let ok = end == CopyEnd::Done(true);
        state.l1.cache().finish_store(&writing, ok);
        // To the tiers below (L2 writes them behind) only once the copy into L1 is complete.
        if let (true, Some(tiers)) = (ok, state.tiers.get()) {
            tiers.stored(&written_keys, digest);
        }
        if end == CopyEnd::Done(false) {
            tracing::warn!(
                region = region_id,
                "a store's copy failed; its chunks were dropped"
            );
        }
    };
    let reply = move |done_slot| {
        Reply::Store(StoreReply {
            outcomes,
            done_slot,
        })
    };
    copy(
        state,
        to,
        &region,
        Direction::D2h,
        runs,
        s.wait_slot,
        Deadline::from_wire(s.deadline_ns),
        settle,
        reply,
    );
}

/// Retrieves chunks; answered here when none is held, else by the copy worker. Chunks that a
/// lookup reported while the disk tier reads them back are waited for first (up to
/// `--disk-deadline-ms`; those not there by then are missing).
pub fn retrieve(state: &Arc<State>, tasks: &TaskTracker, to: ReplyTo, r: Retrieve) {
    let (region, keys) = match prepare(
        state,
        to.peer,
        r.region,
        r.salt,
        &r.chunks,
        true,
        r.wait_slot,
    ) {
        Ok(x) => x,
        Err(e) => return to.send(Err(e)),
    };
    if state.tiers.get().is_some_and(|t| t.answers_early()) && state.l1.cache().filling(&keys) {
        let state = state.clone();
        tasks.spawn(async move {
            if let Some(tiers) = state.tiers.get() {
                tiers.settle(&state.l1, &keys).await;
            }
            retrieve_held(&state, to, r, &region, &keys);
        });
        return;
    }
    retrieve_held(state, to, r, &region, &keys);
}

/// A retrieve's copy of the chunks L1 holds now.
fn retrieve_held(state: &Arc<State>, to: ReplyTo, r: Retrieve, region: &Region, keys: &[Key]) {
    let pin = (r.pin_id != 0).then_some((r.pin_id, region.shard));
    let plans = state
        .l1
        .cache()
        .begin_retrieve(region.class, keys, r.pin_id == 0);
    let mut runs = Vec::new();
    let mut reading = Vec::new();
    let mut outcomes = Vec::with_capacity(plans.len());
    for (plan, chunk) in plans.iter().zip(&r.chunks) {
        outcomes.push(match plan {
            Some(p) => {
                region
                    .geometry
                    .push_runs(&chunk.blocks, p.offset, &mut runs);
                reading.push(p.entry);
                RetrieveOutcome::Loaded
            }
            None => RetrieveOutcome::Missing,
        });
    }
    let m = &state.metrics;
    m.retrieve_chunks
        .with_label_values(&["loaded"])
        .inc_by(reading.len() as u64);
    m.retrieve_chunks
        .with_label_values(&["missing"])
        .inc_by((outcomes.len() - reading.len()) as u64);
    if runs.is_empty() {
        // Nothing to copy: no chunk held, or every block of those held skipped.
        state.l1.cache().finish_retrieve(&reading, pin);
        return to.send(Ok(Reply::Retrieve(RetrieveReply {
            outcomes,
            done_slot: None,
        })));
    }
    // A retrieve the device refused does not count as a reader of the lookup's pin; one that
    // expired does: its client has given up on it and will not retrieve again.
    let settle = move |state: &State, end: CopyEnd| {
        let pin = if end == CopyEnd::NotSubmitted {
            None
        } else {
            pin
        };
        state.l1.cache().finish_retrieve(&reading, pin);
    };
    let reply = move |done_slot| {
        Reply::Retrieve(RetrieveReply {
            outcomes,
            done_slot,
        })
    };
    copy(
        state,
        to,
        region,
        Direction::H2d,
        runs,
        r.wait_slot,
        Deadline::from_wire(r.deadline_ns),
        settle,
        reply,
    );
}

/// How a copy ended, for the request to settle its entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CopyEnd {
    /// The device refused the job; nothing was copied.
    NotSubmitted,
    /// The client's deadline passed before the copy could start; nothing was copied.
    Expired,
    /// The copy completed, successfully or not.
    Done(bool),
}

/// Hands a request's runs to its device; [`Transfer`] answers and settles.
#[allow(clippy::too_many_arguments)]
fn copy<S, R>(
    state: &Arc<State>,
    to: ReplyTo,
    region: &Region,
    direction: Direction,
    mut runs: Vec<CopyRun>,
    wait_slot: Option<u16>,
    deadline: Option<Deadline>,
    settle: S,
    reply: R,
) where
    S: FnOnce(&State, CopyEnd) + Send + 'static,
    R: FnOnce(Option<u16>) -> Reply + Send + 'static,
{
    // Chunks in neighbouring pages merge into one descriptor, but never across a pinned piece.
    kvd_gpu::copy::coalesce_within(&mut runs, &state.settings.layout);
    let bytes = total_bytes(&runs);
    let job = CopyJob {
        direction,
        imports: region.imports.clone(),
        runs,
        wait_slot,
    };
    let listener = Transfer {
        state: state.clone(),
        to: Some(to),
        reply: Some(reply),
        settle: Some(settle),
        direction,
        bytes,
    };
    region.worker.submit(job, deadline, Box::new(listener));
}

/// One store's or retrieve's copy in flight: replies and settles the cache from the copy
/// worker's threads.
struct Transfer<S, R> {
    state: Arc<State>,
    /// Taken once the reply is sent.
    to: Option<ReplyTo>,
    reply: Option<R>,
    settle: Option<S>,
    direction: Direction,
    bytes: u64,
}

impl<S, R> CopyListener for Transfer<S, R>
where
    S: FnOnce(&State, CopyEnd) + Send + 'static,
    R: FnOnce(Option<u16>) -> Reply + Send + 'static,
{
    fn submitted(&mut self, result: Result<Option<u16>, SubmitError>) {
        match result {
            // The client polls kvd's event: answer now, settle when the copy is done.
            Ok(Some(slot)) => {
                if let (Some(to), Some(reply)) = (self.to.take(), self.reply.take()) {
                    to.send(Ok(reply(Some(slot))));
                }
            }
            // No event: the reply waits for the copy.
            Ok(None) => {}
            Err(e) => {
                let end = match e {
                    SubmitError::Expired { .. } => CopyEnd::Expired,
                    _ => CopyEnd::NotSubmitted,
                };
                if let Some(settle) = self.settle.take() {
                    settle(&self.state, end);
                }
                if let Some(to) = self.to.take() {
                    to.send(Err(e.into()));
                }
            }
        }
    }

    fn done(mut self: Box<Self>, result: Result<(), GpuError>) {
        let ok = result.is_ok();
        if let Some(settle) = self.settle.take() {
            settle(&self.state, CopyEnd::Done(ok));
        }
        if ok {
            let m = &self.state.metrics;
            match self.direction {
                Direction::D2h => m.bytes_stored.inc_by(self.bytes),
                Direction::H2d => m.bytes_retrieved.inc_by(self.bytes),
            }
        }
        let Some(to) = self.to.take() else { return };
        to.send(match (result, self.reply.take()) {
            (Ok(()), Some(reply)) => Ok(reply(None)),
            _ => Err(RequestError::CopyFailed(match self.direction {
                Direction::D2h => "the copy into the pool failed; nothing was stored",
                Direction::H2d => {
                    "the copy from the pool failed; treat every chunk as missing and recompute"
                }
            })),
        });
    }
}
