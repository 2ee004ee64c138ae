//! What is stored: the index from key to page, entry states, pins and eviction. Pure logic — no
//! I/O, no clocks of its own (callers pass `now`) — behind one lock in the server, held only for
//! the few microseconds an operation takes.
//!
//! An entry is `Writing` while its store's copy runs and `Ready` after; only `Ready` entries are
//! hits. A pin is a count on the entry: lookups pin the chunks they report until a retrieve,
//! a release, a timeout or the session's end; copies pin what they read or write. A pinned
//! entry is outside the eviction policy, so eviction can never take it.

use std::collections::HashMap;

use tokio::time::{Duration, Instant};

use crate::evict::{EntryId, EvictionPolicy, PolicyKind};
use crate::pool::{ClassError, ClassId, Home, Page, PagePool, Usage};

mod demote;
pub use demote::Demotion;

/// A session's id, for pin ownership.
pub type SessionId = u64;

/// What a stored chunk is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// Model and layout fingerprint.
    pub fingerprint: u64,
    /// Hash of the cache salt.
    pub salt: u64,
    /// KV shard.
    pub shard: u32,
    /// Chained chunk hash.
    pub hash: u128,
}

impl Key {
    /// A 64-bit digest of the whole key, for policies that remember evicted keys.
    pub fn digest(&self) -> u64 {
        let h = (self.hash as u64) ^ ((self.hash >> 64) as u64).rotate_left(29);
        let m = h
            ^ self.fingerprint.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ self.salt.rotate_left(17)
            ^ u64::from(self.shard).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        m ^ (m >> 31)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Writing,
    Ready,
    /// Evicted, out of the index, its page held until the disk tier has written it
    /// ([`demote`]).
    Demoting,
}

#[derive(Debug)]
struct Entry {
    key: Key,
    class: ClassId,
    page: Page,
    state: State,
    pins: u32,
    /// When the policy last put it at the young end (the cache's clock): comparable across
    /// classes, so the oldest data of the whole pool can be found.
    used: u64,
}

#[derive(Debug)]
struct ShardPins {
    shard: u32,
    readers_left: u16,
    entries: Vec<EntryId>,
}

#[derive(Debug)]
struct PinSet {
    owner: SessionId,
    deadline: Instant,
    shards: Vec<ShardPins>,
}

/// The plan for one chunk of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StorePlan {
    /// Copy into the page at this offset; then call [`Cache::finish_store`].
    Write {
        /// The new entry.
        entry: EntryId,
        /// Its page's byte offset in the pool.
        offset: u64,
    },
    /// Already stored or being stored.
    Present,
    /// No page could be had.
    Refused,
    /// Not tried: an earlier chunk was refused, so this one could never be part of a hit.
    Skipped,
}

/// Where one chunk of a retrieve comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadPlan {
    /// The entry, pinned until [`Cache::finish_retrieve`].
    pub entry: EntryId,
    /// Its page's byte offset in the pool.
    pub offset: u64,
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Entries evicted.
    pub evictions: u64,
    /// Store chunks refused (including skipped ones).
    pub store_refusals: u64,
    /// Pin sets that timed out.
    pub pins_expired: u64,
}

/// A snapshot for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    /// Pool bytes and their use.
    pub usage: Usage,
    /// Bytes the usable (pinned) slabs cover.
    pub capacity_bytes: u64,
    /// Bytes of the whole pool, usable or still being populated and pinned.
    pub total_bytes: u64,
    /// Stored or storing chunks.
    pub entries: u64,
    /// Pages with at least one pin.
    pub pinned_pages: u64,
    /// Lookup pins held.
    pub pin_sets: u64,
    /// Counters.
    pub counters: Counters,
}

/// The index, pins and eviction over a [`PagePool`].
#[derive(Debug)]
pub struct Cache {
    pool: PagePool,
    entries: Vec<Option<Entry>>,
    free_ids: Vec<EntryId>,
    map: HashMap<Key, EntryId>,
    policy_kind: PolicyKind,
    policies: Vec<Box<dyn EvictionPolicy>>,
    /// The entry in each allocated page, to empty a whole slab.
    page_owner: HashMap<Page, EntryId>,
    clock: u64,
    pins: HashMap<u64, PinSet>,
    next_pin: u64,
    pinned_pages: u64,
    counters: Counters,
    /// Evicted chunks waiting for the disk tier, when there is one.
    demote: Option<demote::Demoter>,
}

impl Cache {
    /// An empty cache over `pool`.
    pub fn new(pool: PagePool, policy_kind: PolicyKind) -> Self {
        Cache {
            pool,
            entries: Vec::new(),
            free_ids: Vec::new(),
            map: HashMap::new(),
            policy_kind,
            policies: Vec::new(),
            page_owner: HashMap::new(),
            clock: 0,
            pins: HashMap::new(),
            next_pin: 1,
            pinned_pages: 0,
            counters: Counters::default(),
            demote: None,
        }
    }

    /// The page class for a page size (made on first use).
    pub fn class_for(&mut self, page_bytes: u64) -> Result<ClassId, ClassError> {
        let class = self.pool.class_for(page_bytes)?;
        while self.policies.len() < self.pool.class_count() {
            self.policies.push(self.policy_kind.build());
        }
        Ok(class)
    }

    /// Page size of a class.
    pub fn page_bytes(&self, class: ClassId) -> u64 {
        self.pool.page_bytes(class)
    }

    /// Hands the pool's slabs `0..slabs` to the allocator once they are populated and pinned.
    pub fn grow_pool(&mut self, slabs: u32) {
        self.pool.grow_to(slabs);
    }

    fn entry(&self, id: EntryId) -> &Entry {
        self.entries[id as usize].as_ref().expect("live entry id")
    }

    fn entry_mut(&mut self, id: EntryId) -> &mut Entry {
        self.entries[id as usize].as_mut().expect("live entry id")
    }

    fn ready(&self, key: &Key) -> Option<EntryId> {
        let &id = self.map.get(key)?;
        (self.entry(id).state == State::Ready).then_some(id)
    }

    fn pin(&mut self, id: EntryId) {
        let class = self.entry(id).class;
        let e = self.entry_mut(id);
        e.pins += 1;
        if e.pins == 1 {
            self.pinned_pages += 1;
            self.policies[class.0 as usize].remove(id);
        }
    }

    fn unpin(&mut self, id: EntryId) {
        let Some(e) = self.entries.get_mut(id as usize).and_then(Option::as_mut) else {
            debug_assert!(false, "unpin of a dead entry");
            return;
        };
        debug_assert!(e.pins > 0);
        e.pins = e.pins.saturating_sub(1);
        if e.pins == 0 {
            self.pinned_pages -= 1;
            if e.state == State::Ready {
                let class = e.class;
                self.clock += 1;
                e.used = self.clock;
                self.policies[class.0 as usize].insert(id);
            }
        }
    }

    fn remove(&mut self, id: EntryId) {
        let e = self.entries[id as usize].take().expect("live entry id");
        debug_assert_eq!(e.pins, 0, "removing a pinned entry");
        self.policies[e.class.0 as usize].forget(id, e.key.digest());
        // A demoting entry left the index already, and its key may name a newer entry since.
        if e.state != State::Demoting {
            self.map.remove(&e.key);
        }
        self.page_owner.remove(&e.page);
        self.pool.free(e.class, e.page);
        self.free_ids.push(id);
    }

    /// A page of `class`, evicting as needed. The victim is the least recently used entry of
    /// `class`, unless another class holds older data: then a whole slab of that class, the one
    /// holding its oldest entry, is emptied and changes class. So a model that starts after the
    /// pool has filled with another model's chunks (another page size) grows into the pool
    /// instead of being held to the one slab it could take. A slab with a pinned page is not
    /// taken; eviction then falls back to single entries.
    fn alloc_page(&mut self, class: ClassId, near: Option<Home>) -> Option<Page> {
        loop {
            if let Some(page) = self.pool.alloc_near(class, near) {
                self.clean_ahead(class);
                return Some(page);
            }
            let own = self.policies[class.0 as usize].peek_victim();
            let other = (0..self.policies.len())
                .filter(|&c| c != class.0 as usize)
                .filter_map(|c| self.policies[c].peek_victim())
                .min_by_key(|&id| self.entry(id).used);
            let victim = match (own, other) {
                (Some(o), Some(x)) if self.entry(x).used < self.entry(o).used => {
                    if self.empty_slab_of(x) {
                        continue;
                    }
                    o
                }
                (Some(o), _) => o,
                (None, Some(x)) => {
                    if self.empty_slab_of(x) {
                        continue;
                    }
                    x
                }
                (None, None) => return None,
            };
            self.remove(victim);
            self.counters.evictions += 1;
            self.note_unwritten();
        }
    }

    /// Evicts every entry in the slab holding `id`'s page, which returns the slab to the pool;
    /// false, evicting nothing, when a page there is pinned (being written, read or looked up).
    fn empty_slab_of(&mut self, id: EntryId) -> bool {
        let (class, slab) = {
            let e = self.entry(id);
            (e.class, e.page.slab)
        };
        let ids: Vec<EntryId> = (0..self.pool.pages_per_slab(class))
            .filter_map(|index| self.page_owner.get(&Page { slab, index }).copied())
            .collect();
        if ids.iter().any(|&i| self.entry(i).pins > 0) {
            return false;
        }
        for i in ids {
            self.remove(i);
            self.counters.evictions += 1;
        }
        true
    }

    /// Longest prefix of `hashes` stored on every shard; pins it when `pin` is set and the hit
    /// is not empty. Returns the hit and the pin id (0 for none).
    #[allow(clippy::too_many_arguments)]
    pub fn lookup(
        &mut self,
        owner: SessionId,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
        pin: bool,
        readers: u16,
        now: Instant,
        ttl: Duration,
    ) -> (u32, u64) {
        let mut hit: Vec<Vec<EntryId>> = vec![Vec::new(); shards.len()];
        'chunks: for &hash in hashes {
            let mut ids = Vec::with_capacity(shards.len());
            for &shard in shards {
                match self.ready(&Key {
                    fingerprint,
                    salt,
                    shard,
                    hash,
                }) {
                    Some(id) => ids.push(id),
                    None => break 'chunks,
                }
            }
            for (per_shard, id) in hit.iter_mut().zip(ids) {
                per_shard.push(id);
            }
        }
        let n = hit.first().map_or(0, Vec::len) as u32;
        if shards.is_empty() || n == 0 {
            return (0, 0);
        }
        for per_shard in &hit {
            for &id in per_shard {
                let class = self.entry(id).class;
                if self.policy_kind == PolicyKind::Lru {
                    self.clock += 1;
                    self.entry_mut(id).used = self.clock;
                }
                self.policies[class.0 as usize].touch(id);
            }
        }
        if !pin {
            return (n, 0);
        }
        for per_shard in &hit {
            for &id in per_shard {
                self.pin(id);
            }
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
        (n, pin_id)
    }

    /// Length of the prefix of `hashes` that is ready on every shard, touching nothing: what
    /// a lookup would report, for the L2 tier to know what it must fetch.
    pub fn ready_prefix(
        &self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
    ) -> u32 {
        if shards.is_empty() {
            return 0;
        }
        hashes
            .iter()
            .take_while(|&&hash| {
                shards.iter().all(|&shard| {
                    self.ready(&Key {
                        fingerprint,
                        salt,
                        shard,
                        hash,
                    })
                    .is_some()
                })
            })
            .count() as u32
    }

    /// Pins a ready chunk so that its page can be read outside the lock (writing it behind to
    /// L2); returns where it is and its size. Unpin with [`Cache::finish_retrieve`].
    pub fn pin_ready(&mut self, key: &Key) -> Option<(ReadPlan, u64)> {
        let id = self.ready(key)?;
        let e = self.entry(id);
        let (offset, bytes) = (
            self.pool.offset(e.class, e.page),
            self.pool.page_bytes(e.class),
        );
        self.pin(id);
        Some((ReadPlan { entry: id, offset }, bytes))
    }

    /// Plans a store of `keys` into pages of `class`: new keys get a page (evicting if need be)
    /// and a `Writing` entry; once a chunk is refused the rest are skipped.
    pub fn begin_store(&mut self, class: ClassId, keys: &[Key]) -> Vec<StorePlan> {
        self.begin_store_near(class, keys, None)
    }

    /// Like [`Cache::begin_store`], taking pages at pool home `near` (the storing GPU's NUMA
    /// node) while it has room.
    pub fn begin_store_near(
        &mut self,
        class: ClassId,
        keys: &[Key],
        near: Option<Home>,
    ) -> Vec<StorePlan> {
        let mut refused = false;
        let mut plans = Vec::with_capacity(keys.len());
        for key in keys {
            if refused {
                plans.push(StorePlan::Skipped);
                self.counters.store_refusals += 1;
                continue;
            }
            if self.map.contains_key(key) {
                plans.push(StorePlan::Present);
                continue;
            }
            let Some(page) = self.alloc_page(class, near) else {
                refused = true;
                plans.push(StorePlan::Refused);
                self.counters.store_refusals += 1;
                continue;
            };
            let id = self.free_ids.pop().unwrap_or_else(|| {
                self.entries.push(None);
                (self.entries.len() - 1) as EntryId
            });
            self.entries[id as usize] = Some(Entry {
                key: *key,
                class,
                page,
                state: State::Writing,
                pins: 1,
                used: 0,
            });
            self.policies[class.0 as usize].created(id, key.digest());
            self.page_owner.insert(page, id);
            self.pinned_pages += 1;
            self.map.insert(*key, id);
            plans.push(StorePlan::Write {
                entry: id,
                offset: self.pool.offset(class, page),
            });
        }
        plans
    }

    /// Ends a store's copy: the entries become hits, or on failure are dropped.
    pub fn finish_store(&mut self, entries: &[EntryId], ok: bool) {
        for &id in entries {
            if ok {
                self.entry_mut(id).state = State::Ready;
                self.unpin(id);
            } else {
                let e = self.entry_mut(id);
                e.pins -= 1;
                self.pinned_pages -= 1;
                self.remove(id);
            }
        }
    }

    /// Finds and pins the pages of `keys` for a retrieve into pages of `class`.
    pub fn begin_retrieve(&mut self, class: ClassId, keys: &[Key]) -> Vec<Option<ReadPlan>> {
        keys.iter()
            .map(|key| {
                let id = self.ready(key)?;
                let e = self.entry(id);
                if e.class != class {
                    return None;
                }
                let offset = self.pool.offset(class, e.page);
                self.pin(id);
                Some(ReadPlan { entry: id, offset })
            })
            .collect()
    }

    /// Ends a retrieve's copy: unpins its pages and, with `pin`, counts one reader of that
    /// lookup pin's shard as done.
    pub fn finish_retrieve(&mut self, entries: &[EntryId], pin: Option<(u64, u32)>) {
        for &id in entries {
            self.unpin(id);
        }
        if let Some((pin_id, shard)) = pin {
            self.release_reader(pin_id, shard);
        }
    }

    fn release_reader(&mut self, pin_id: u64, shard: u32) {
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
        for id in done.entries {
            self.unpin(id);
        }
    }

    fn drop_pin_set(&mut self, set: PinSet) -> u32 {
        let mut n = 0;
        for shard in set.shards {
            n += shard.entries.len() as u32;
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

    /// Drops pins whose deadline has passed; returns how many.
    pub fn expire(&mut self, now: Instant) -> usize {
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

    /// A snapshot for metrics and the stats request.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            usage: self.pool.usage(),
            capacity_bytes: self.pool.capacity_bytes(),
            total_bytes: self.pool.total_bytes(),
            entries: self.map.len() as u64,
            pinned_pages: self.pinned_pages,
            pin_sets: self.pins.len() as u64,
            counters: self.counters,
        }
    }

    /// Checks the cross-structure invariants; for tests.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) {
        let live: Vec<(EntryId, &Entry)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (i as EntryId, e)))
            .collect();
        let demoting = live
            .iter()
            .filter(|(_, e)| e.state == State::Demoting)
            .count();
        assert_eq!(live.len() - demoting, self.map.len());
        assert_eq!(live.len(), self.page_owner.len());
        for (id, e) in &live {
            assert_eq!(self.page_owner.get(&e.page), Some(id));
        }
        assert_eq!(self.pool.used_pages(), live.len() as u64);
        for (_, e) in &live {
            assert!(
                e.page.slab < self.pool.ready_slabs(),
                "a page outside the pinned slabs"
            );
        }
        for (id, e) in live.iter().filter(|(_, e)| e.state != State::Demoting) {
            assert_eq!(self.map.get(&e.key), Some(id));
        }
        assert_eq!(
            self.pinned_pages,
            live.iter().filter(|(_, e)| e.pins > 0).count() as u64
        );
        let evictable = live
            .iter()
            .filter(|(_, e)| e.pins == 0 && e.state == State::Ready)
            .count();
        assert_eq!(
            self.policies.iter().map(|p| p.len()).sum::<usize>(),
            evictable
        );
        let pin_refs: u64 = self
            .pins
            .values()
            .flat_map(|s| &s.shards)
            .map(|s| s.entries.len() as u64)
            .sum();
        assert!(pin_refs <= live.iter().map(|(_, e)| e.pins as u64).sum::<u64>());
        let u = self.pool.usage();
        assert_eq!(
            u.used_bytes + u.free_bytes + u.slack_bytes,
            self.pool.capacity_bytes()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const TTL: Duration = Duration::from_secs(60);

    fn key(shard: u32, hash: u128) -> Key {
        Key {
            fingerprint: 1,
            salt: 0,
            shard,
            hash,
        }
    }

    fn cache(pages: u64) -> (Cache, ClassId) {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(pages * 1024, 1024).unwrap()),
            PolicyKind::Lru,
        );
        let class = c.class_for(1024).unwrap();
        (c, class)
    }

    fn store(c: &mut Cache, class: ClassId, keys: &[Key]) -> Vec<StorePlan> {
        let plans = c.begin_store(class, keys);
        let ids: Vec<EntryId> = plans
            .iter()
            .filter_map(|p| match p {
                StorePlan::Write { entry, .. } => Some(*entry),
                _ => None,
            })
            .collect();
        c.finish_store(&ids, true);
        plans
    }

    #[test]
    fn lookup_counts_the_prefix_on_every_shard() {
        let (mut c, class) = cache(16);
        let now = Instant::now();
        store(
            &mut c,
            class,
            &[key(0, 1), key(0, 2), key(0, 3), key(1, 1), key(1, 2)],
        );
        assert_eq!(
            c.lookup(9, 1, 0, &[0], &[1, 2, 3, 4], false, 1, now, TTL),
            (3, 0)
        );
        assert_eq!(
            c.lookup(9, 1, 0, &[0, 1], &[1, 2, 3], false, 1, now, TTL).0,
            2
        );
        assert_eq!(
            c.lookup(9, 1, 0, &[0], &[2, 3], false, 1, now, TTL).0,
            2,
            "keys are chained by the client"
        );
        assert_eq!(
            c.lookup(9, 1, 7, &[0], &[1], false, 1, now, TTL).0,
            0,
            "another salt misses"
        );
        assert_eq!(
            c.lookup(9, 2, 0, &[0], &[1], false, 1, now, TTL).0,
            0,
            "another model misses"
        );
        assert_eq!(c.lookup(9, 1, 0, &[], &[1], true, 1, now, TTL), (0, 0));
    }

    #[test]
    fn writing_entries_are_not_hits_and_failed_stores_vanish() {
        let (mut c, class) = cache(4);
        let now = Instant::now();
        let plans = c.begin_store(class, &[key(0, 1)]);
        let StorePlan::Write { entry, .. } = plans[0] else {
            panic!()
        };
        assert_eq!(c.lookup(1, 1, 0, &[0], &[1], false, 1, now, TTL).0, 0);
        assert_eq!(c.begin_store(class, &[key(0, 1)]), vec![StorePlan::Present]);
        c.finish_store(&[entry], false);
        assert_eq!(c.stats().entries, 0);
        c.check_invariants();
    }

    #[test]
    fn pinned_pages_are_never_evicted_and_a_full_pool_refuses() {
        let (mut c, class) = cache(4);
        let now = Instant::now();
        store(&mut c, class, &[key(0, 1), key(0, 2), key(0, 3), key(0, 4)]);
        let (hit, pin) = c.lookup(1, 1, 0, &[0], &[1, 2, 3, 4], true, 1, now, TTL);
        assert_eq!((hit, pin != 0), (4, true));
        let plans = c.begin_store(class, &[key(0, 10), key(0, 11)]);
        assert_eq!(plans, vec![StorePlan::Refused, StorePlan::Skipped]);
        assert_eq!(c.stats().counters.store_refusals, 2);
        assert_eq!(
            c.lookup(1, 1, 0, &[0], &[1, 2, 3, 4], false, 1, now, TTL).0,
            4
        );
        assert_eq!(c.release(pin), 4);
        assert_eq!(c.release(pin), 0);
        let plans = store(&mut c, class, &[key(0, 10)]);
        assert!(matches!(plans[0], StorePlan::Write { .. }));
        assert_eq!(c.stats().counters.evictions, 1);
        assert_eq!(
            c.lookup(1, 1, 0, &[0], &[1], false, 1, now, TTL).0,
            0,
            "LRU victim was chunk 1"
        );
        c.check_invariants();
    }

    #[test]
    fn a_retrieve_releases_its_shard_of_the_pin_after_every_reader() {
        let (mut c, class) = cache(8);
        let now = Instant::now();
        store(&mut c, class, &[key(0, 1), key(0, 2)]);
        let (_, pin) = c.lookup(1, 1, 0, &[0], &[1, 2], true, 2, now, TTL);
        for reader in 0..2 {
            let plans = c.begin_retrieve(class, &[key(0, 1), key(0, 2)]);
            let ids: Vec<EntryId> = plans.iter().map(|p| p.unwrap().entry).collect();
            assert_eq!(c.stats().pinned_pages, 2);
            c.finish_retrieve(&ids, Some((pin, 0)));
            assert_eq!(c.stats().pin_sets, 1 - reader, "reader {reader}");
        }
        assert_eq!(c.stats().pinned_pages, 0);
        c.check_invariants();
    }

    #[test]
    fn pins_expire_and_die_with_their_session() {
        let (mut c, class) = cache(8);
        let t0 = Instant::now();
        store(&mut c, class, &[key(0, 1)]);
        c.lookup(1, 1, 0, &[0], &[1], true, 1, t0, Duration::from_secs(10));
        c.lookup(2, 1, 0, &[0], &[1], true, 1, t0, Duration::from_secs(100));
        assert_eq!(c.expire(t0 + Duration::from_secs(9)), 0);
        assert_eq!(c.expire(t0 + Duration::from_secs(10)), 1);
        assert_eq!(c.stats().pinned_pages, 1);
        assert_eq!(c.release_owner(2), 1);
        assert_eq!(c.stats().pinned_pages, 0);
        assert_eq!(c.stats().counters.pins_expired, 1);
        c.check_invariants();
    }

    #[test]
    fn a_new_page_size_takes_slabs_from_another_class() {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(4 * 1024, 1024).unwrap()),
            PolicyKind::Lru,
        );
        let small = c.class_for(512).unwrap();
        let big = c.class_for(1024).unwrap();
        store(
            &mut c,
            small,
            &(0..8).map(|h| key(0, h)).collect::<Vec<_>>(),
        );
        let plans = store(&mut c, big, &[key(1, 100)]);
        assert!(matches!(plans[0], StorePlan::Write { .. }));
        assert_eq!(
            c.stats().counters.evictions,
            2,
            "one slab of two small pages"
        );
        c.check_invariants();
    }

    /// A pool of `slabs` slabs of 1 KiB and two page classes: model A's 256-byte pages (four
    /// per slab) and model B's 1 KiB pages (one per slab).
    fn two_models(slabs: u64) -> (Cache, ClassId, ClassId) {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(slabs * 1024, 1024).unwrap()),
            PolicyKind::Lru,
        );
        let a = c.class_for(256).unwrap();
        let b = c.class_for(1024).unwrap();
        (c, a, b)
    }

    /// How many of `hashes` on `shard` are hits (a prefix count, without pinning).
    fn hits(c: &mut Cache, shard: u32, hashes: impl IntoIterator<Item = u128>) -> u32 {
        let hs: Vec<u128> = hashes.into_iter().collect();
        c.lookup(9, 1, 0, &[shard], &hs, false, 1, Instant::now(), TTL)
            .0
    }

    #[test]
    fn a_model_that_starts_after_the_pool_filled_grows_into_it() {
        // Model A (small pages, shard 0) fills all 16 slabs; then model B (page = slab, shard 1)
        // stores while A is idle. B must end up with the pool, not the one slab it could take.
        let (mut c, a, b) = two_models(16);
        store(&mut c, a, &(0..64).map(|h| key(0, h)).collect::<Vec<_>>());
        assert_eq!(c.pool.class_slabs(a), 16);
        for h in 0..16 {
            let plans = store(&mut c, b, &[key(1, 1000 + h)]);
            assert!(
                matches!(plans[0], StorePlan::Write { .. }),
                "store {h}: {plans:?}"
            );
            c.check_invariants();
        }
        assert_eq!(c.pool.class_slabs(b), 16);
        assert_eq!(hits(&mut c, 1, 1000..1016), 16, "every chunk of B is kept");
        assert_eq!(hits(&mut c, 0, 0..64), 0);
    }

    #[test]
    fn another_class_keeps_its_slabs_while_its_data_is_younger() {
        let (mut c, a, b) = two_models(4);
        store(&mut c, b, &[key(1, 1), key(1, 2)]);
        store(&mut c, a, &(0..8).map(|h| key(0, h)).collect::<Vec<_>>());
        // A's chunks are read after B's were stored: B evicts its own oldest chunk.
        assert_eq!(hits(&mut c, 0, 0..8), 8);
        store(&mut c, b, &[key(1, 3)]);
        assert_eq!(hits(&mut c, 0, 0..8), 8);
        assert_eq!(hits(&mut c, 1, [1]), 0);
        assert_eq!(hits(&mut c, 1, [2]), 1);
        // Now B's chunks are the younger ones: the next store of B takes one of A's slabs.
        assert_eq!(hits(&mut c, 1, [2]), 1);
        assert_eq!(hits(&mut c, 1, [3]), 1);
        store(&mut c, b, &[key(1, 4)]);
        assert_eq!(
            hits(&mut c, 1, [2]) + hits(&mut c, 1, [3]) + hits(&mut c, 1, [4]),
            3
        );
        assert_eq!(
            hits(&mut c, 0, 0..8),
            0,
            "A's oldest chunks (and their slab-mates) went"
        );
        c.check_invariants();
    }

    #[test]
    fn a_slab_holding_a_pinned_page_is_not_taken() {
        let (mut c, a, b) = two_models(2);
        store(&mut c, a, &(0..8).map(|h| key(0, h)).collect::<Vec<_>>());
        // Pin A's oldest chunk (in slab 0) as a lookup would before a retrieve.
        let (n, pin) = c.lookup(9, 1, 0, &[0], &[0], true, 1, Instant::now(), TTL);
        assert_eq!((n, pin != 0), (1, true));
        let plans = store(&mut c, b, &[key(1, 100)]);
        assert!(matches!(plans[0], StorePlan::Write { .. }));
        // Slab 1 moved to B; slab 0 kept its pinned chunk.
        assert_eq!(hits(&mut c, 0, [0]), 1);
        assert_eq!(c.pool.class_slabs(b), 1);
        c.check_invariants();
    }

    #[derive(Debug, Clone)]
    enum Op {
        Store(u8, Vec<u8>),
        Lookup(Vec<u8>, bool),
        Retrieve(u8, Vec<u8>),
        Release(u8),
        Expire(u8),
        EndSession,
        Grow,
    }

    fn op() -> impl Strategy<Value = Op> {
        let hashes = proptest::collection::vec(0u8..24, 1..6);
        prop_oneof![
            4 => (0u8..2, hashes.clone()).prop_map(|(c, h)| Op::Store(c, h)),
            3 => (hashes.clone(), any::<bool>()).prop_map(|(h, p)| Op::Lookup(h, p)),
            2 => (0u8..2, hashes).prop_map(|(c, h)| Op::Retrieve(c, h)),
            1 => any::<u8>().prop_map(Op::Release),
            1 => (0u8..30).prop_map(Op::Expire),
            1 => Just(Op::EndSession),
            1 => Just(Op::Grow),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Under every policy, any sequence of operations keeps the index, pool, pins and policy
        /// consistent, and a lookup hit is never reported for a chunk that a retrieve then
        /// misses while pinned.
        #[test]
        fn invariants_hold(
            kind in prop_oneof![Just(PolicyKind::Lru), Just(PolicyKind::Fifo), Just(PolicyKind::S3Fifo)],
            ops in proptest::collection::vec(op(), 1..120),
        ) {
            // The pool starts with 2 of its 6 slabs and grows while the cache serves.
            let mut c = Cache::new(PagePool::growing(&kvd_gpu::PoolLayout::new(6 * 2048, 2048).unwrap()), kind);
            c.grow_pool(2);
            let classes = [c.class_for(1024).unwrap(), c.class_for(700).unwrap()];
            let t0 = Instant::now();
            let mut now = t0;
            let mut pins: Vec<(u64, Vec<u128>)> = Vec::new();
            let mut writing: Vec<Vec<EntryId>> = Vec::new();
            for op in ops {
                match op {
                    Op::Store(ci, hs) => {
                        let keys: Vec<Key> = hs.iter().map(|&h| key(ci as u32, h as u128)).collect();
                        let plans = c.begin_store(classes[ci as usize], &keys);
                        writing.push(plans.iter().filter_map(|p| match p { StorePlan::Write { entry, .. } => Some(*entry), _ => None }).collect());
                        // Finish the oldest store half the time, so some stay in flight.
                        if writing.len() > 1 {
                            let ids = writing.remove(0);
                            c.finish_store(&ids, hs.len() % 3 != 0);
                        }
                    }
                    Op::Lookup(hs, pin) => {
                        let hs: Vec<u128> = hs.iter().map(|&h| h as u128).collect();
                        let (n, pin_id) = c.lookup(1, 1, 0, &[0], &hs, pin, 1, now, Duration::from_secs(10));
                        if pin_id != 0 {
                            pins.push((pin_id, hs[..n as usize].to_vec()));
                        }
                    }
                    Op::Retrieve(ci, hs) => {
                        let keys: Vec<Key> = hs.iter().map(|&h| key(ci as u32, h as u128)).collect();
                        let plans = c.begin_retrieve(classes[ci as usize], &keys);
                        let ids: Vec<EntryId> = plans.iter().flatten().map(|p| p.entry).collect();
                        c.finish_retrieve(&ids, None);
                    }
                    Op::Release(i) if !pins.is_empty() => {
                        let (id, _) = pins.remove(i as usize % pins.len());
                        c.release(id);
                    }
                    Op::Release(_) => {}
                    Op::Expire(secs) => {
                        now += Duration::from_secs(secs as u64);
                        c.expire(now);
                        pins.retain(|(id, _)| c.pins.contains_key(id));
                    }
                    Op::EndSession => {
                        c.release_owner(1);
                        pins.clear();
                    }
                    Op::Grow => {
                        let slabs = c.pool.ready_slabs() + 1;
                        c.grow_pool(slabs);
                    }
                }
                c.check_invariants();
                // Every chunk under a live pin is still a hit.
                for (_, hs) in &pins {
                    let keys: Vec<Key> = hs.iter().map(|&h| key(0, h)).collect();
                    let plans = c.begin_retrieve(classes[0], &keys);
                    prop_assert!(plans.iter().all(Option::is_some));
                    let ids: Vec<EntryId> = plans.iter().flatten().map(|p| p.entry).collect();
                    c.finish_retrieve(&ids, None);
                }
            }
        }
    }
}
