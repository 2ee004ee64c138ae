//! Lookup pins: a lookup pins the chunks it reports so that they cannot be evicted before the
//! retrieve; the pin ends after every reader of each shard retrieved, on release, on timeout or
//! with its session. Lookup pins may hold at most a share of the pool
//! ([`Cache::with_lookup_pin_frac`]): requests waiting for GPU blocks hold their pins for as long
//! as they wait, and a pool full of them refuses every store. A lookup over the budget pins the
//! head of its hit that fits and reports the rest unpinned and *held* (`holds`): evictable, but
//! only when nothing else is, so stores find pages. (Reporting a shorter hit instead was measured on the agentic traces: with the
//! waiting requests' pins holding the budget, most lookups then reported nothing and the hit
//! rate fell from 27% to 2%.) vLLM serves its waiting queue in order, so the earlier lookups,
//! which keep their pins, are the ones served first.

use tokio::time::{Duration, Instant};

use super::{Cache, SessionId};
use crate::l1::evict::EntryId;

/// Default share of the pool's pages that lookup pins may hold.
pub const DEFAULT_LOOKUP_PIN_FRAC: f64 = 0.5;

#[derive(Debug)]
pub(super) struct ShardPins {
    pub(super) shard: u32,
    pub(super) readers_left: u16,
    pub(super) entries: Vec<EntryId>,
}

#[derive(Debug)]
pub(super) struct PinSet {
    pub(super) owner: SessionId,
    pub(super) deadline: Instant,
    pub(super) shards: Vec<ShardPins>,
}

impl Cache {
    /// Lets lookup pins hold at most `frac` of the pool's pages (default
    /// [`DEFAULT_LOOKUP_PIN_FRAC`]; 1.0: no bound).
    pub fn with_lookup_pin_frac(mut self, frac: f64) -> Self {
        self.lookup_pin_frac = frac.clamp(0.0, 1.0);
        self
    }

    /// How many more chunk pins lookups may take, counted in pages of `entry`'s class.
    pub(super) fn lookup_pin_room(&self, entry: EntryId) -> u64 {
        let class = self.entry(entry).class;
        let pages = self.pool.capacity_bytes() / self.pool.page_bytes(class).max(1);
        let budget = (pages as f64 * self.lookup_pin_frac) as u64;
        budget.saturating_sub(self.lookup_pin_refs)
    }

    /// Pins the chunks of a lookup hit (one list per shard) under a new pin id.
    pub(super) fn pin_lookup(
        &mut self,
        owner: SessionId,
        shards: &[u32],
        hit: Vec<Vec<EntryId>>,
        readers: u16,
        now: Instant,
        ttl: Duration,
    ) -> u64 {
        for per_shard in &hit {
            for &id in per_shard {
                self.pin(id);
            }
            self.lookup_pin_refs += per_shard.len() as u64;
        }
        let pin_id = self.next_pin;
        self.next_pin += 1;
        self.pins.insert(
            pin_id,
            PinSet {
                owner,
                deadline: now + ttl,
                shards: shards
                    .iter()
                    .zip(hit)
                    .map(|(&shard, entries)| ShardPins {
                        shard,
                        readers_left: readers.max(1),
                        entries,
                    })
                    .collect(),
            },
        );
        pin_id
    }

    pub(super) fn release_reader(&mut self, pin_id: u64, shard: u32) {
        let Some(set) = self.pins.get_mut(&pin_id) else {
            return;
        };
        let Some(pos) = set.shards.iter().position(|s| s.shard == shard) else {
            return;
        };
        set.shards[pos].readers_left -= 1;
        if set.shards[pos].readers_left > 0 {
            return;
        }
        let done = set.shards.swap_remove(pos);
        if set.shards.is_empty() {
            self.pins.remove(&pin_id);
        }
        self.lookup_pin_refs -= done.entries.len() as u64;
        for id in done.entries {
            self.unpin(id);
        }
    }

    fn drop_pin_set(&mut self, set: PinSet) -> u32 {
        let mut n = 0;
        for shard in set.shards {
            n += shard.entries.len() as u32;
            self.lookup_pin_refs -= shard.entries.len() as u64;
            for id in shard.entries {
                self.unpin(id);
            }
        }
        n
    }

    /// Drops a lookup pin; returns the chunk pins released (0 if it had already ended).
    pub fn release(&mut self, pin_id: u64) -> u32 {
        match self.pins.remove(&pin_id) {
            Some(set) => self.drop_pin_set(set),
            None => 0,
        }
    }

    /// Drops a pin if `owner` holds it: one session cannot drop another's pins (ids are
    /// sequential, so guessable). Returns the chunks released, 0 for a pin not its own.
    pub fn release_own(&mut self, owner: SessionId, pin_id: u64) -> u32 {
        match self.pins.get(&pin_id) {
            Some(set) if set.owner == owner => self.release(pin_id),
            _ => 0,
        }
    }

    /// Drops every pin a session holds.
    pub fn release_owner(&mut self, owner: SessionId) -> u32 {
        let ids: Vec<u64> = self
            .pins
            .iter()
            .filter(|(_, s)| s.owner == owner)
            .map(|(&id, _)| id)
            .collect();
        ids.into_iter().map(|id| self.release(id)).sum()
    }

    /// Drops pins whose deadline has passed, and ends the lookup holds that ran out; returns
    /// how many pins.
    pub fn expire(&mut self, now: Instant) -> usize {
        self.expire_holds(now);
        let ids: Vec<u64> = self
            .pins
            .iter()
            .filter(|(_, s)| s.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for &id in &ids {
            self.release(id);
        }
        self.counters.pins_expired += ids.len() as u64;
        ids.len()
    }
}
