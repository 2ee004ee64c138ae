//! Lookup holds: a short, bounded, soft protection for the chunks a lookup reports but cannot
//! pin. Past the lookup pins' share of the pool ([`super::pins`]) a lookup reports the rest of
//! its hit unpinned; the client retrieves it moments later (within a second for nearly all of
//! them on the agentic traces). Until then such a chunk is *held*: out of the eviction policy,
//! in a FIFO of held chunks per page class. A store or a fill takes a held chunk only when the
//! policy has nothing left to give (the oldest hold first, counted), so holds never make a
//! store refused: what the pin budget is for stays true. A hold ends at the chunk's retrieve, or after `hold_ttl` (expired by
//! [`Cache::expire`]), and holds cover at most a share of the pool's pages (past it a chunk is
//! reported unpinned and unheld, as before holds existed).
//!
//! Why: with a disk tier every lookup that finds its prefix on disk fills fresh L1 pages, so
//! the pool turns over several times faster than stores alone make it, and each fill evicted
//! (then: demoted ahead of need) the policy's next victim, often a chunk a lookup had just
//! reported unpinned: its retrieve then found it gone, a failed load the client recomputes
//! (202–496 of ~2,300 loads on the agentic traces, 4 without the disk tier;
//! `benches/RESULTS.md`).
//!
//! A held chunk that a pin takes (a retrieve, another lookup's pin) leaves the FIFO while
//! pinned and comes back to it when unpinned, unless its hold has run out by the latest time
//! the cache was told. The FIFO is in order of holding, so [`Cache::expire`] ends holds from
//! its old end; one that came back from a pin behind younger holds ends at most one
//! `hold_ttl` late.

use tokio::time::{Duration, Instant};

use super::{Cache, State};
use crate::l1::evict::EntryId;

/// Default share of the pool's pages that lookup holds may cover.
pub const DEFAULT_LOOKUP_HOLD_FRAC: f64 = 0.5;

/// Default time a lookup hold lasts without a retrieve.
pub const DEFAULT_LOOKUP_HOLD: Duration = Duration::from_secs(10);

impl Cache {
    /// Lets lookup holds cover at most `frac` of the pool's pages, each for at most `ttl`
    /// (defaults [`DEFAULT_LOOKUP_HOLD_FRAC`], [`DEFAULT_LOOKUP_HOLD`]); `frac` 0 or a zero
    /// `ttl`: no holds.
    pub fn with_lookup_holds(mut self, frac: f64, ttl: Duration) -> Self {
        self.hold_frac = frac.clamp(0.0, 1.0);
        self.hold_ttl = ttl;
        self
    }

    /// Holds the chunks a lookup reported without a pin, as far as the holds' share allows.
    pub(super) fn hold_reported(&mut self, ids: impl IntoIterator<Item = EntryId>, now: Instant) {
        self.seen(now);
        if self.hold_frac <= 0.0 || self.hold_ttl.is_zero() {
            return;
        }
        let deadline = now + self.hold_ttl;
        for id in ids {
            if self.entry(id).hold.is_some() {
                self.refresh_hold(id, deadline);
                self.counters.hold_chunks += 1;
                continue;
            }
            let class = self.entry(id).class;
            let pages = self.pool.capacity_bytes() / self.pool.page_bytes(class).max(1);
            if self.held >= (pages as f64 * self.hold_frac) as u64 {
                self.counters.hold_budget_chunks += 1;
                continue;
            }
            self.held += 1;
            self.counters.hold_chunks += 1;
            let e = self.entry_mut(id);
            e.hold = Some(deadline);
            if e.pins == 0 && e.state == State::Ready {
                self.policies[class.0 as usize].remove(id);
                self.holds[class.0 as usize].push_front(id);
            }
        }
    }

    /// A held chunk reported again: its hold starts anew, at the young end.
    fn refresh_hold(&mut self, id: EntryId, deadline: Instant) {
        let class = self.entry(id).class.0 as usize;
        self.entry_mut(id).hold = Some(deadline);
        if self.holds[class].unlink(id) {
            self.holds[class].push_front(id);
        }
    }

    /// Ends `id`'s hold, if any. A chunk neither pinned nor held goes back to its policy.
    pub(super) fn unhold(&mut self, id: EntryId) {
        // In the FIFO only while neither pinned nor being written or demoted.
        if self.drop_hold(id) {
            self.clock += 1;
            self.entry_mut(id).used = self.clock;
            let class = self.entry(id).class.0 as usize;
            self.policies[class].insert(id);
        }
    }

    /// Ends `id`'s hold, if any, leaving it in no FIFO and no policy; whether it was in its
    /// class's FIFO of holds.
    pub(super) fn drop_hold(&mut self, id: EntryId) -> bool {
        let e = self.entry_mut(id);
        if e.hold.take().is_none() {
            return false;
        }
        let class = e.class.0 as usize;
        self.held -= 1;
        self.holds[class].unlink(id)
    }

    /// Whether a chunk whose last pin just went stays held (its hold has not run out by the
    /// latest time the cache was told); if so it is back in its class's FIFO of holds.
    pub(super) fn rehold(&mut self, id: EntryId) -> bool {
        let now_seen = self.now_seen;
        let e = self.entry_mut(id);
        let Some(deadline) = e.hold else {
            return false;
        };
        if now_seen.is_some_and(|now| deadline <= now) {
            e.hold = None;
            self.held -= 1;
            return false;
        }
        let class = e.class.0 as usize;
        self.holds[class].push_front(id);
        true
    }

    /// The oldest held chunk of `class`, for an allocation that found no other victim.
    pub(super) fn oldest_hold(&self, class: usize) -> Option<EntryId> {
        self.holds.get(class).and_then(|h| h.oldest())
    }

    /// Ends the holds that ran out by `now`; returns how many.
    pub(super) fn expire_holds(&mut self, now: Instant) -> usize {
        self.seen(now);
        let mut n = 0;
        for class in 0..self.holds.len() {
            while let Some(id) = self.holds[class].oldest() {
                if self.entry(id).hold.is_some_and(|d| d > now) {
                    break;
                }
                self.unhold(id);
                n += 1;
            }
        }
        n
    }

    fn seen(&mut self, now: Instant) {
        if self.now_seen.is_none_or(|t| t < now) {
            self.now_seen = Some(now);
        }
    }

    /// Chunks held now.
    pub fn held_chunks(&self) -> u64 {
        self.held
    }
}
