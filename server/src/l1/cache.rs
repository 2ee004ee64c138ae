//! What is stored: the index from key to page, entry states, pins and eviction. Pure logic — no
//! I/O, no clocks of its own (callers pass `now`) — behind one lock in the server, held only for
//! the few microseconds an operation takes.
//!
//! An entry is `Writing` while its store's copy runs and `Ready` after; only `Ready` entries are
//! hits. A pin is a count on the entry: lookups pin the chunks they report until a retrieve,
//! a release, a timeout or the session's end; copies pin what they read or write. A pinned
//! entry is outside the eviction policy, so eviction can never take it.
//!
//! Every entry that leaves the index is recorded in the [`RemovalFeed`] that clients read.
//! The cache also knows the prefix structure (`tree`): each chunk's parent is the one before it
//! in its prompt, so eviction can take tails first and what is stored but unreachable (a chunk
//! whose predecessor is gone) is counted. Lookup pins live in `pins`, the soft protection of
//! what a lookup reports past the pins' share in `holds`, the parents that lookups teach for
//! the first chunk of a later store in `hints`.

mod hints;
mod holds;
mod lookup;
mod pins;
mod store;
mod tree;

use std::collections::{BTreeMap, HashMap};

use crate::l1::events::RemovalFeed;
use crate::l1::evict::{EntryId, EvictionPolicy, LinkedList, PolicyKind};
use crate::l1::pool::{ClassError, ClassId, Home, Page, PagePool, Usage};
use crate::l1::presence::Presence;
use hints::Hints;
pub use holds::{DEFAULT_LOOKUP_HOLD, DEFAULT_LOOKUP_HOLD_FRAC};
use pins::PinSet;
pub use pins::DEFAULT_LOOKUP_PIN_FRAC;
use tree::PrefixTree;

mod demote;
mod pace;
pub use super::key::Key;
pub use demote::Demotion;
pub use lookup::{Query, Want};

/// A session's id, for pin ownership.
pub type SessionId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Writing,
    /// Being read back from the disk tier: a lookup counts and pins it as a hit, and a
    /// retrieve waits for it ([`Cache::filling`]).
    Filling,
    Ready,
    /// Its fill failed while a lookup had it pinned: out of the index, its page freed when
    /// the last pin goes.
    Failed,
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
    /// Until when a lookup that reported it unpinned holds it ([`holds`]).
    hold: Option<tokio::time::Instant>,
    /// Filled from the disk tier, which still has it: evicting it writes nothing
    /// ([`demote`]).
    on_disk: bool,
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
    /// No page could be had (why is counted in [`Counters`]).
    Refused,
    /// Not tried: an earlier chunk was refused, so this one could never be part of a hit. (No
    /// longer planned: every chunk is tried, since a later store of the refused chunk alone
    /// makes the rest reachable again. Kept for the wire's outcome.)
    Skipped,
}

/// Why a store's chunk found no page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    /// Every page is pinned: by lookups (within their share) or by copies in flight.
    Pinned,
    /// The pool has no usable page of this size (still starting, or no slab can change class).
    NoPages,
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
    /// Of those, refused because every page was pinned.
    pub refused_pinned: u64,
    /// Of those, refused because the pool had no usable page.
    pub refused_no_pages: u64,
    /// Lookup hit chunks reported unpinned because lookup pins held their share of the pool.
    pub pin_budget_chunks: u64,
    /// Pin sets that timed out.
    pub pins_expired: u64,
    /// Lookup hit chunks reported unpinned and held until their retrieve ([`holds`]).
    pub hold_chunks: u64,
    /// Lookup hit chunks reported unpinned and not held, because holds covered their share.
    pub hold_budget_chunks: u64,
    /// Held chunks evicted because nothing else could be.
    pub holds_evicted: u64,
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
    /// Chunks held for a lookup's retrieve ([`holds`]).
    pub held_chunks: u64,
    /// Stored chunks whose prefix is broken (a chunk before them is not held), and their bytes.
    pub unreachable_chunks: u64,
    /// Bytes of those chunks.
    pub unreachable_bytes: u64,
    /// Page bytes of evicted chunks the disk tier's write thread is still writing ([`demote`]).
    pub disk_writing_bytes: u64,
    /// The reserve of pages L1 keeps for those writes ([`pace`]).
    pub disk_reserve_bytes: u64,
    /// Chunks lookups took back from the disk tier's writes ([`demote`]).
    pub disk_taken_back: u64,
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
    pins: BTreeMap<u64, PinSet>,
    next_pin: u64,
    /// Chunk pins held by lookup pin sets, and the share of the pool's pages they may hold.
    lookup_pin_refs: u64,
    lookup_pin_frac: f64,
    /// Held chunks that are evictable but for their hold, oldest first, per class; how many
    /// chunks are held (in these FIFOs or pinned); their share and duration ([`holds`]).
    holds: Vec<LinkedList>,
    held: u64,
    hold_frac: f64,
    hold_ttl: tokio::time::Duration,
    /// The latest time the cache was told (a lookup's or an expiry's `now`).
    now_seen: Option<tokio::time::Instant>,
    tree: PrefixTree,
    hints: Hints,
    pinned_pages: u64,
    counters: Counters,
    removals: RemovalFeed,
    /// Evicted chunks waiting for the disk tier, when there is one.
    demote: Option<demote::Demoter>,
    /// The keys of `map`, counted for clients on this host ([`Presence`]).
    presence: Option<Presence>,
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
            pins: BTreeMap::new(),
            next_pin: 1,
            lookup_pin_refs: 0,
            lookup_pin_frac: DEFAULT_LOOKUP_PIN_FRAC,
            holds: Vec::new(),
            held: 0,
            hold_frac: DEFAULT_LOOKUP_HOLD_FRAC,
            hold_ttl: DEFAULT_LOOKUP_HOLD,
            now_seen: None,
            tree: PrefixTree::default(),
            hints: Hints::default(),
            pinned_pages: 0,
            counters: Counters::default(),
            removals: RemovalFeed::new(crate::l1::events::DEFAULT_CAPACITY),
            demote: None,
            presence: None,
        }
    }

    /// The same cache keeping `presence` ([`Presence`]) in step with its index.
    pub fn with_presence(mut self, presence: Presence) -> Self {
        debug_assert!(self.map.is_empty());
        self.presence = Some(presence);
        self
    }

    /// The presence filter's file, if the cache keeps one.
    pub fn presence_path(&self) -> Option<&std::path::Path> {
        self.presence.as_ref().map(Presence::path)
    }

    /// The same cache with a removal feed of `records` records.
    pub fn with_feed_capacity(mut self, records: usize) -> Self {
        self.removals = RemovalFeed::new(records);
        self
    }

    /// The chunks that left the index, for clients' `Events` requests.
    pub fn removals(&self) -> &RemovalFeed {
        &self.removals
    }

    /// The page class for a page size (made on first use).
    pub fn class_for(&mut self, page_bytes: u64) -> Result<ClassId, ClassError> {
        let class = self.pool.class_for(page_bytes)?;
        while self.policies.len() < self.pool.class_count() {
            self.policies.push(self.policy_kind.build());
            self.holds.push(LinkedList::default());
        }
        Ok(class)
    }

    /// Whether `key` is stored or being stored.
    pub fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
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

    /// A chunk a lookup may report: ready, or being read back from disk.
    fn available(&self, key: &Key) -> Option<EntryId> {
        let &id = self.map.get(key)?;
        matches!(self.entry(id).state, State::Ready | State::Filling).then_some(id)
    }

    /// Whether any of `keys` is still being read back from disk: a retrieve of them waits.
    pub fn filling(&self, keys: &[Key]) -> bool {
        keys.iter().any(|k| {
            self.map
                .get(k)
                .is_some_and(|&id| self.entry(id).state == State::Filling)
        })
    }

    fn pin(&mut self, id: EntryId) {
        let class = self.entry(id).class;
        let e = self.entry_mut(id);
        e.pins += 1;
        let (first, held) = (e.pins == 1, e.hold.is_some());
        if first {
            self.pinned_pages += 1;
            if held {
                self.holds[class.0 as usize].unlink(id);
            } else {
                self.policies[class.0 as usize].remove(id);
            }
        }
    }

    /// A lookup found `id` (or a retrieve by key read it): its use is recorded.
    pub(super) fn touch(&mut self, id: EntryId) {
        let class = self.entry(id).class;
        if self.policy_kind == PolicyKind::Lru {
            self.clock += 1;
            self.entry_mut(id).used = self.clock;
        }
        self.policies[class.0 as usize].touch(id);
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
            if e.state == State::Failed {
                self.free_page(id);
                return;
            }
            if e.state == State::Ready && !self.rehold(id) {
                self.clock += 1;
                let clock = self.clock;
                let e = self.entry_mut(id);
                e.used = clock;
                let class = e.class;
                self.policies[class.0 as usize].insert(id);
            }
        }
    }

    fn remove(&mut self, id: EntryId) {
        debug_assert_eq!(self.entry(id).pins, 0, "removing a pinned entry");
        self.unindex(id);
        self.free_page(id);
    }

    /// Takes `id` out of the index, the prefix tree, the policy and the holds: it is evicted,
    /// though its page may still be in use (a failed fill under a lookup's pin).
    fn unindex(&mut self, id: EntryId) {
        self.drop_hold(id);
        let (key, class) = {
            let e = self.entry(id);
            (e.key, e.class)
        };
        // Let `set_leaf` pass over the entry itself while the tree lets go of it.
        let e = self.entries[id as usize].take().expect("live entry id");
        let (entries, policies) = (&self.entries, &mut self.policies);
        self.tree.remove(id, &key, &mut |n, leaf| {
            set_leaf(entries, policies, n, leaf)
        });
        self.entries[id as usize] = Some(e);
        self.policies[class.0 as usize].forget(id, key.digest());
        if self.map.remove(&key).is_some() {
            if let Some(p) = &self.presence {
                p.remove(&key);
            }
        }
        self.removals.push(key);
    }

    /// Frees `id`'s page and the entry (out of the index already).
    fn free_page(&mut self, id: EntryId) {
        let e = self.entries[id as usize].take().expect("live entry id");
        self.page_owner.remove(&e.page);
        self.pool.free(e.class, e.page);
        self.free_ids.push(id);
    }

    /// A page of `class`, evicting as needed. The victim is the least recently used entry of
    /// `class`, unless another class holds older data: then a whole slab of that class, the one
    /// holding its oldest entry, is emptied and changes class. So a model that starts after the
    /// pool has filled with another model's chunks (another page size) grows into the pool
    /// instead of being held to the one slab it could take. A slab with a pinned page is not
    /// taken; eviction then falls back to single entries. A chunk held for a lookup's retrieve
    /// goes only when nothing else can ([`holds`]). With a disk tier a victim may go to the
    /// disk tier with its page ([`demote`]); the allocation then evicts again.
    fn alloc_page(
        &mut self,
        class: ClassId,
        near: Option<Home>,
        may_evict: bool,
    ) -> Result<Page, Refusal> {
        loop {
            if self.may_take_free(class) {
                if let Some(page) = self.pool.alloc_near(class, near) {
                    return Ok(page);
                }
            }
            if !may_evict {
                return Err(Refusal::NoPages);
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
                // Nothing else left: a free page kept for the disk tier's writes, else a chunk
                // held for a retrieve (the oldest hold), rather than a refused store.
                (None, None) => {
                    if self.demote.is_some() {
                        if let Some(page) = self.pool.alloc_near(class, near) {
                            return Ok(page);
                        }
                    }
                    match self.oldest_hold(class.0 as usize) {
                        Some(h) => {
                            self.counters.holds_evicted += 1;
                            h
                        }
                        None if self.pinned_pages > 0 => return Err(Refusal::Pinned),
                        None => return Err(Refusal::NoPages),
                    }
                }
            };
            if let Some(page) = self.evict(victim, class, near) {
                return Ok(page);
            }
        }
    }

    /// Evicts every entry in the slab holding `id`'s page, which returns the slab to the pool;
    /// false, evicting nothing, when a page there is pinned (being written, read or looked up)
    /// or held for a lookup's retrieve.
    fn empty_slab_of(&mut self, id: EntryId) -> bool {
        let (class, slab) = {
            let e = self.entry(id);
            (e.class, e.page.slab)
        };
        let ids: Vec<EntryId> = (0..self.pool.pages_per_slab(class))
            .filter_map(|index| self.page_owner.get(&Page { slab, index }).copied())
            .collect();
        if ids
            .iter()
            .any(|&i| self.entry(i).pins > 0 || self.entry(i).hold.is_some())
            || self.writes_slab(slab)
        {
            return false;
        }
        for i in ids {
            self.remove(i);
            self.counters.evictions += 1;
        }
        true
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

    /// Finds and pins the pages of `keys` for a retrieve into pages of `class`. `by_key`: no
    /// lookup's pin backs it (a client that stores and retrieves by key, like the data-plane
    /// benchmark): then the retrieve is the chunks' read, and counts as one for eviction, so a
    /// hot set such a client re-reads is not taken for chunks that are never read. (A lookup
    /// already counted the read of the chunks it pinned.)
    pub fn begin_retrieve(
        &mut self,
        class: ClassId,
        keys: &[Key],
        by_key: bool,
    ) -> Vec<Option<ReadPlan>> {
        keys.iter()
            .map(|key| {
                let id = self.ready(key)?;
                let (own_class, page) = (self.entry(id).class, self.entry(id).page);
                if own_class != class {
                    return None;
                }
                if by_key {
                    self.touch(id);
                }
                let offset = self.pool.offset(class, page);
                self.pin(id);
                // The read a hold waited for.
                self.unhold(id);
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

    /// A snapshot for metrics and the stats request.
    pub fn stats(&self) -> CacheStats {
        CacheStats {
            usage: self.pool.usage(),
            capacity_bytes: self.pool.capacity_bytes(),
            total_bytes: self.pool.total_bytes(),
            entries: self.map.len() as u64,
            pinned_pages: self.pinned_pages,
            pin_sets: self.pins.len() as u64,
            held_chunks: self.held,
            unreachable_chunks: self.tree.unreachable_chunks(),
            unreachable_bytes: self.tree.unreachable_bytes(),
            disk_writing_bytes: self.demotions_writing_bytes(),
            disk_reserve_bytes: self.demotion_reserve_bytes(),
            disk_taken_back: self.demotions_taken_back(),
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
        let unindexed = |e: &Entry| e.state == State::Failed;
        let demoting = live.iter().filter(|(_, e)| unindexed(e)).count();
        assert_eq!(live.len() - demoting, self.map.len());
        assert_eq!(live.len(), self.page_owner.len());
        for (id, e) in &live {
            assert_eq!(self.page_owner.get(&e.page), Some(id));
        }
        let writing = self.demotions_writing_pages();
        for (class, page) in &writing {
            assert!(
                !self.page_owner.contains_key(page),
                "a page being written has an entry"
            );
            assert!(self.demotions_writing_bytes() >= self.pool.page_bytes(*class));
        }
        assert_eq!(
            self.pool.used_pages(),
            live.len() as u64 + writing.len() as u64
        );
        for (_, e) in &live {
            assert!(
                e.page.slab < self.pool.ready_slabs(),
                "a page outside the pinned slabs"
            );
        }
        for (id, e) in live.iter().filter(|(_, e)| !unindexed(e)) {
            assert_eq!(self.map.get(&e.key), Some(id));
        }
        assert_eq!(
            self.pinned_pages,
            live.iter().filter(|(_, e)| e.pins > 0).count() as u64
        );
        let evictable = |held: bool| {
            live.iter()
                .filter(|(_, e)| e.pins == 0 && e.state == State::Ready)
                .filter(|(_, e)| e.hold.is_some() == held)
                .count()
        };
        assert_eq!(
            self.policies.iter().map(|p| p.len()).sum::<usize>(),
            evictable(false)
        );
        for (_, e) in live.iter().filter(|(_, e)| unindexed(e)) {
            assert!(
                e.pins > 0,
                "a chunk out of the index keeps its page only while pinned"
            );
        }
        assert_eq!(
            writing
                .iter()
                .map(|(c, _)| self.pool.page_bytes(*c))
                .sum::<u64>(),
            self.demotions_writing_bytes()
        );
        assert_eq!(
            self.holds.iter().map(|h| h.len()).sum::<usize>(),
            evictable(true)
        );
        for (id, e) in &live {
            let queued = self.holds[e.class.0 as usize].contains(*id);
            assert_eq!(
                queued,
                e.hold.is_some() && e.pins == 0 && e.state == State::Ready
            );
        }
        assert_eq!(
            self.held,
            live.iter().filter(|(_, e)| e.hold.is_some()).count() as u64
        );
        let pin_refs: u64 = self
            .pins
            .values()
            .flat_map(|s| &s.shards)
            .map(|s| s.entries.len() as u64)
            .sum();
        assert!(pin_refs <= live.iter().map(|(_, e)| e.pins as u64).sum::<u64>());
        self.tree.check(&self.map);
        assert_eq!(pin_refs, self.lookup_pin_refs);
        let u = self.pool.usage();
        assert_eq!(
            u.used_bytes + u.free_bytes + u.slack_bytes,
            self.pool.capacity_bytes()
        );
    }
}

#[cfg(test)]
mod tests;

/// Tells `n`'s policy whether it is a leaf of the prefix tree (a free function so that the tree
/// can call it while the cache lends it its fields).
fn set_leaf(
    entries: &[Option<Entry>],
    policies: &mut [Box<dyn EvictionPolicy>],
    n: EntryId,
    leaf: bool,
) {
    if let Some(e) = entries.get(n as usize).and_then(Option::as_ref) {
        policies[e.class.0 as usize].set_leaf(n, leaf);
    }
}
