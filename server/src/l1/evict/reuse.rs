//! Prefix-aware, reuse-distance eviction (`--eviction prefix-reuse`): like `prefix` it takes
//! only leaves of the prefix tree while any is evictable, but it picks among them by when each
//! is likely to be read next rather than by when it was read last. LRU is the worst choice on
//! the agentic traces' shape: every conversation re-reads its whole context each turn, so the
//! conversation idle longest is often the next to come back (a loop larger than the pool).
//!
//! Each entry keeps its last reuse distance (the policy's clock ticks once per store and per
//! read, so a distance is the traffic between two reads of the chunk); a chunk not read yet
//! takes its parent's (the conversation's pace), else one of the guesses below. The next read
//! is predicted at last use + distance. The victim is the least recently used leaf if it is
//! overdue (idle for more than 1.5 distances: its conversation has likely ended or moved on),
//! else the leaf whose predicted next read is furthest away. The 1.5 was chosen on half of the
//! 48 agentic traces (`benches/RESULTS.md`). Victim choice is O(log n): ordered sets by last
//! use and by predicted next use.
//!
//! A chunk with nothing to go by (not read, parent unread or absent) used to take the mean
//! distance, 0 before any read: it was overdue at once and the policy was LRU. The agentic
//! traces open with the first turns of two dozen conversations, ~10,000 chunks, arriving
//! together and coming back in about the same order: a loop larger than the pool, where LRU
//! keeps nothing that is read again, so nothing is read and no distance is learnt (on half A
//! at ~25%, the first 100 lookups hit nothing where MIN hit 47% of their chunks). Keeping such
//! chunks unknown only until the first read did not help: the first reads (a shared head, a
//! request asking again while it waits) are short, and the mean they set made new chunks
//! overdue again. So a chunk that a lookup asked for before it was stored (the client reads
//! by lookup, as vLLM does) and that inherits no distance has an [`UNKNOWN`] one until it is
//! read: predicted furthest, and overdue only once idle for 1.5 times the longest reuse
//! distance seen (never before any read). Among such leaves the newest goes first, so the pool
//! keeps what it holds of the conversations that are read and, of the others, the ones stored
//! first (what MIN does with a loop): ~0.82 → ~0.95 of MIN's hits on those traces
//! (`benches/RESULTS.md`); the overdue bound keeps chunks that are never read from holding
//! their pages for good against newer ones. A chunk nobody asked for (a client that stores and retrieves by
//! key, like the data-plane benchmark) takes the mean, so before any read the oldest goes
//! first: taking the newest there made a burst of stores evict itself before its retrieves
//! (session 5). The mean starts at the first distance seen.
//!
//! A chunk nobody asked for and nobody has read yet is on probation: such leaves go first,
//! oldest first, before any chunk that was read or asked for. Without it a store stream of
//! chunks that are never read (a client that stores by key, at the link's rate) pushed out a
//! hot set that another client re-read: the stream's chunks took the mean distance, and the
//! hot chunks, read less often than the stream stored, fell overdue (the data-plane
//! benchmark's interference section: every retrieve of its hot set missing). vLLM's chunks are
//! asked for by a lookup before they are stored, so none of this changes what it sees.
//!
//! (A MIN-like admission — refusing a new chunk when the victim it would displace is predicted
//! to be read sooner — was tried: 0.815 of MIN on its own events against 0.749 without, but
//! fewer hits, 57.5% against 63.1% of chunks, on the same 24 traces; so it is not used.)

use std::collections::BTreeSet;

use super::{EntryId, EvictionPolicy};

/// Overdue after idling `OVERDUE_NUM / OVERDUE_DEN` reuse distances.
const OVERDUE_NUM: u64 = 3;
const OVERDUE_DEN: u64 = 2;

/// The distance of a chunk asked for by a lookup with nothing to predict its next read by (see
/// the module header).
const UNKNOWN: u64 = u64::MAX / 4;

#[derive(Debug, Clone, Copy)]
struct Meta {
    /// Clock at the last store or read.
    last: u64,
    /// Last reuse distance (or inherited estimate).
    distance: u64,
    leaf: bool,
    queued: bool,
    /// A lookup asked for it before it was stored.
    asked: bool,
    /// It was read since it was stored.
    read: bool,
}

impl Meta {
    /// On probation (see the module header): nobody asked for it or read it.
    fn probation(&self) -> bool {
        !self.asked && !self.read
    }
}

const FRESH: Meta = Meta {
    last: 0,
    distance: 0,
    leaf: true,
    queued: false,
    asked: false,
    read: false,
};

/// See the module header.
#[derive(Debug, Default)]
pub(super) struct PrefixReuse {
    clock: u64,
    meta: Vec<Meta>,
    /// Evictable leaves by last use, and by predicted next use.
    by_last: BTreeSet<(u64, EntryId)>,
    by_next: BTreeSet<(u64, EntryId)>,
    /// Evictable entries with successors held, by last use.
    inner: BTreeSet<(u64, EntryId)>,
    /// Evictable leaves on probation, by last use (also in `by_last` and `by_next`).
    probation: BTreeSet<(u64, EntryId)>,
    /// Mean reuse distance seen (an exponentially weighted mean, 1/16 per sample, starting at
    /// the first); 0 until a read is seen.
    mean_distance: u64,
    /// Longest reuse distance seen: an unknown chunk idle for 1.5 times that is overdue.
    max_distance: u64,
}

impl PrefixReuse {
    fn meta_mut(&mut self, id: EntryId) -> &mut Meta {
        let i = id as usize;
        if self.meta.len() <= i {
            self.meta.resize(i + 1, FRESH);
        }
        &mut self.meta[i]
    }

    fn next_of(m: &Meta) -> u64 {
        m.last.saturating_add(m.distance)
    }

    fn dequeue(&mut self, id: EntryId) -> bool {
        let Some(&m) = self.meta.get(id as usize) else {
            return false;
        };
        if !m.queued {
            return false;
        }
        if m.leaf {
            self.by_last.remove(&(m.last, id));
            self.by_next.remove(&(Self::next_of(&m), id));
            self.probation.remove(&(m.last, id));
        } else {
            self.inner.remove(&(m.last, id));
        }
        self.meta[id as usize].queued = false;
        true
    }

    fn enqueue(&mut self, id: EntryId) {
        let m = self.meta_mut(id);
        m.queued = true;
        let m = *m;
        if m.leaf {
            self.by_last.insert((m.last, id));
            self.by_next.insert((Self::next_of(&m), id));
            if m.probation() {
                self.probation.insert((m.last, id));
            }
        } else {
            self.inner.insert((m.last, id));
        }
    }

    fn overdue(&self, m: &Meta) -> bool {
        let distance = match m.distance {
            // Unread for longer than any chunk went between reads: it is not coming back. (With
            // no read seen there is nothing to compare with, and it is kept.)
            UNKNOWN if self.max_distance == 0 => return false,
            UNKNOWN => self.max_distance,
            d => d,
        };
        (self.clock - m.last).saturating_mul(OVERDUE_DEN) > distance.saturating_mul(OVERDUE_NUM)
    }
}

impl EvictionPolicy for PrefixReuse {
    fn insert(&mut self, id: EntryId) {
        let m = *self.meta_mut(id);
        if m.queued {
            return;
        }
        if m.last == 0 {
            // First time evictable (its store finished): its use starts now.
            self.clock += 1;
            let (clock, mean) = (self.clock, self.mean_distance);
            let m = self.meta_mut(id);
            m.last = clock;
            if m.distance == 0 {
                m.distance = if m.asked { UNKNOWN } else { mean.max(1) };
            }
        }
        self.enqueue(id);
    }

    fn touch(&mut self, id: EntryId) {
        if id as usize >= self.meta.len() {
            return;
        }
        let queued = self.dequeue(id);
        self.clock += 1;
        let clock = self.clock;
        let m = &mut self.meta[id as usize];
        if m.last != 0 {
            let d = (clock - m.last).max(1);
            m.distance = d;
            self.mean_distance = match self.mean_distance {
                0 => d,
                mean => mean - mean / 16 + d / 16,
            };
            self.max_distance = self.max_distance.max(d);
        }
        self.meta[id as usize].last = clock;
        self.meta[id as usize].read = true;
        if queued {
            self.enqueue(id);
        }
    }

    fn remove(&mut self, id: EntryId) {
        self.dequeue(id);
    }

    fn created(&mut self, id: EntryId, _key: u64) {
        self.dequeue(id);
        *self.meta_mut(id) = FRESH;
    }

    fn inherit(&mut self, id: EntryId, parent: EntryId) {
        let Some(&p) = self.meta.get(parent as usize) else {
            return;
        };
        let m = self.meta_mut(id);
        // An unknown parent teaches nothing: the chunk gets its own guess when it is inserted.
        if !m.queued && m.last == 0 && p.distance != UNKNOWN {
            m.distance = p.distance;
        }
    }

    fn asked(&mut self, id: EntryId) {
        self.meta_mut(id).asked = true;
    }

    fn set_leaf(&mut self, id: EntryId, leaf: bool) {
        let m = *self.meta_mut(id);
        if m.leaf == leaf {
            return;
        }
        let queued = self.dequeue(id);
        self.meta[id as usize].leaf = leaf;
        if queued {
            self.enqueue(id);
        }
    }

    /// Not when it is on probation (nobody asked for it or read it) or overdue (its
    /// conversation has likely ended or moved on): the victims that are chosen because the
    /// pool is too small, not because they are done with, are the ones a disk serves again.
    fn likely_read_again(&self, id: EntryId) -> bool {
        self.meta
            .get(id as usize)
            .is_some_and(|m| !m.probation() && !self.overdue(m))
    }

    fn peek_victim(&self) -> Option<EntryId> {
        if let Some(&(_, id)) = self.probation.first() {
            return Some(id);
        }
        if let Some(&(_, id)) = self.by_last.first() {
            if self.overdue(&self.meta[id as usize]) {
                return Some(id);
            }
        }
        self.by_next
            .last()
            .or_else(|| self.inner.first())
            .map(|&(_, id)| id)
    }

    fn len(&self) -> usize {
        self.by_last.len() + self.inner.len()
    }
}
