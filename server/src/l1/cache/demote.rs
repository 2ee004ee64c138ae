//! L1's side of the disk tier: eviction at need, the victim's page written by the disk tier.
//!
//! Without a disk tier a store that finds no free page evicts the policy's victim and takes
//! its page. With one, eviction is the same, in the same order and at the same moment: only
//! what becomes of the victim differs. A victim the disk holds already (it came from there) is
//! freed, losing nothing. One the policy expects to be read again
//! ([`crate::l1::evict::EvictionPolicy::likely_read_again`], the admission) leaves the index
//! like any victim, and its page goes to the disk tier's write thread, which writes the chunk
//! straight from it and gives the page back when done ([`Cache::finish_demotions`]); the store
//! takes a free page instead. Those free pages and the pages being written make a reserve
//! that stores leave alone: L1 holds chunks in the rest of the pool. A victim not admitted, or
//! met while the writes already hold all of the reserve, is lost as it would be without a disk
//! tier (counted: [`Cache::demotions_not_admitted`], [`Cache::demotions_skipped`]). The
//! reserve's size is paced to the drive ([`super::pace`]) unless it is fixed.
//!
//! So the disk tier costs L1 nothing but the reserve's pages: which chunks L1 keeps is what the
//! policy would keep in a pool smaller by the reserve. The disk tier before this wrote victims *ahead*
//! of need (an eighth of the pool was kept free, being written or written and still a hit):
//! victims chosen up to that far ahead cost `prefix-reuse` 3.8% of its L1 hits on average when
//! live traffic was replayed through the cache alone, and the disk arm stayed 1–2 points below
//! L1 alone on the H200 replay (benches/results/2026-12-04-session-13.md). The price of at-need
//! eviction: a burst of evictions faster than the drive, past `cap`, is not written.
//!
//! A chunk between its eviction and the end of its write is still in its page: a lookup that
//! asks for it takes it back ([`Cache::take_back`]), a hit from that page, which leaves the
//! reserve and stays the chunk's (pinned until the write that reads it is done). Without that,
//! such a chunk was a hit nowhere, and a drive behind lost every chunk read again sooner than
//! it was written. Once written, the disk's index has it too.

use std::collections::HashMap;

use crossbeam_channel::Sender;

use super::pace::Pace;
use super::{Cache, ClassId, EntryId, Home, Key, Page, State};

/// A chunk for the disk tier to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demotion {
    /// The page's ticket: the page is the write thread's until [`Cache::finish_demotions`] is
    /// given it (the chunk's entry is gone already).
    pub ticket: EntryId,
    /// Its key.
    pub key: Key,
    /// Its page's byte offset in the pool.
    pub offset: u64,
    /// Its page's size.
    pub page_bytes: u64,
}

/// The queue of chunks waiting for the disk tier, and the pages it holds.
#[derive(Debug)]
pub(super) struct Demoter {
    /// The reserve's size.
    pace: Pace,
    /// Page bytes handed to the write thread and not yet given back.
    writing_bytes: u64,
    /// Page bytes of chunks taken back whose writes still read their pages: L1's again, but
    /// held until then, so they count against the reserve's room with `writing_bytes`.
    taken_back_bytes: u64,
    /// The pages handed over, by ticket, and the free tickets.
    pages: Vec<Option<(ClassId, Page, Key)>>,
    free_tickets: Vec<EntryId>,
    /// The chunks whose pages are being written, by key: a lookup of one takes it back.
    by_key: HashMap<Key, EntryId>,
    /// Tickets whose chunk a lookup took back, and its new entry: pinned until the write
    /// that still reads its page is done.
    taken_back: HashMap<EntryId, (EntryId, Key, u64)>,
    taken_back_count: u64,
    /// Whether lookups take chunks back ([`Cache::take_back`]); off only for the test of
    /// eviction alone.
    take_back: bool,
    queue: Vec<Demotion>,
    kick: Sender<()>,
    skipped: u64,
    on_disk: u64,
    not_admitted: u64,
}

impl Demoter {
    /// Pages the write thread still reads: being written, or taken back while being written.
    fn held_bytes(&self) -> u64 {
        self.writing_bytes + self.taken_back_bytes
    }
}

impl Cache {
    /// Makes eviction hand victims to the disk tier, keeping `cap_bytes` of the pool for the
    /// pages being written (free or being written); `kick` gets a token whenever the queue
    /// gains one.
    pub fn enable_demotion(&mut self, cap_bytes: u64, kick: Sender<()>) {
        self.demote_with(Pace::fixed(cap_bytes), kick);
    }

    /// As [`Cache::enable_demotion`], with a reserve from `min_bytes` to `max_bytes` paced to
    /// the drive ([`super::pace`]).
    pub fn enable_paced_demotion(&mut self, min_bytes: u64, max_bytes: u64, kick: Sender<()>) {
        self.demote_with(Pace::paced(min_bytes, max_bytes), kick);
    }

    fn demote_with(&mut self, pace: Pace, kick: Sender<()>) {
        // The disk will hold keys the index no longer does: a filter of the index alone would
        // say "not held" of them. Dropping it retires it for every client.
        self.presence = None;
        self.demote = Some(Demoter {
            pace,
            writing_bytes: 0,
            taken_back_bytes: 0,
            pages: Vec::new(),
            free_tickets: Vec::new(),
            by_key: HashMap::new(),
            taken_back: HashMap::new(),
            taken_back_count: 0,
            take_back: true,
            queue: Vec::new(),
            kick,
            skipped: 0,
            on_disk: 0,
            not_admitted: 0,
        });
    }

    /// Whether a store may take a free page of `class` without eating into the reserve kept
    /// for the disk tier's writes. While a large pool is still being pinned after start the
    /// reserve is in proportion to the part that is ready, so that a store waiting for the
    /// pool's growth does not wait for the whole reserve.
    pub(super) fn may_take_free(&self, class: ClassId) -> bool {
        let Some(d) = self.demote.as_ref() else {
            return true;
        };
        let (ready, total) = (self.pool.capacity_bytes(), self.pool.total_bytes().max(1));
        let cap = (u128::from(d.pace.bytes()) * u128::from(ready) / u128::from(total)) as u64;
        let free = self.pool.usage().free_bytes;
        free + d.writing_bytes >= cap + self.pool.page_bytes(class)
    }

    /// Evicts `victim` (unpinned): freed, or handed to the disk tier with its page. Returns a
    /// page for the allocation that evicted it when the victim's own page went to the disk
    /// tier (a free one from the reserve, if one of `class` is to be had; else the caller
    /// evicts again).
    pub(super) fn evict(
        &mut self,
        victim: EntryId,
        class: ClassId,
        near: Option<Home>,
    ) -> Option<Page> {
        self.counters.evictions += 1;
        let (own, on_disk) = {
            let e = self.entry(victim);
            (e.class, e.on_disk)
        };
        let bytes = self.pool.page_bytes(own);
        let Some(d) = self.demote.as_ref() else {
            self.remove(victim);
            return None;
        };
        let held = d.held_bytes();
        let room = held == 0 || held + bytes <= d.pace.bytes();
        let admitted = !on_disk && self.policies[own.0 as usize].likely_read_again(victim);
        if admitted && room {
            self.hand_over(victim);
            return self.pool.alloc_near(class, near);
        }
        let d = self.demote.as_mut().expect("checked");
        match (on_disk, admitted) {
            (true, _) => d.on_disk += 1,
            (false, false) => d.not_admitted += 1,
            (false, true) => {
                d.skipped += 1;
                d.pace.dropped(bytes);
            }
        }
        self.remove(victim);
        None
    }

    /// Takes `victim` out of the index as any victim, and gives its page, still allocated, to
    /// the write thread under a ticket.
    fn hand_over(&mut self, victim: EntryId) {
        self.unindex(victim);
        let e = self.entries[victim as usize].take().expect("live entry id");
        self.page_owner.remove(&e.page);
        self.free_ids.push(victim);
        let (offset, page_bytes) = (
            self.pool.offset(e.class, e.page),
            self.pool.page_bytes(e.class),
        );
        // The free pages matter only to the first hand-over of a busy period (the reserve
        // there); the pool's usage is a walk over its slabs, not for every eviction.
        let starts = self.demote.as_ref().is_some_and(|d| d.held_bytes() == 0);
        let free = if starts {
            self.pool.usage().free_bytes
        } else {
            0
        };
        let Some(d) = self.demote.as_mut() else {
            unreachable!("only a disk tier takes victims");
        };
        let ticket = d.free_tickets.pop().unwrap_or_else(|| {
            d.pages.push(None);
            (d.pages.len() - 1) as EntryId
        });
        d.pages[ticket as usize] = Some((e.class, e.page, e.key));
        d.by_key.insert(e.key, ticket);
        d.pace.handed(d.held_bytes() + page_bytes, free);
        d.writing_bytes += page_bytes;
        d.queue.push(Demotion {
            ticket,
            key: e.key,
            offset,
            page_bytes,
        });
        let _ = d.kick.try_send(());
    }

    /// Whether the disk tier holds a page in `slab` (which may then not change class).
    pub(super) fn writes_slab(&self, slab: u32) -> bool {
        self.demote
            .as_ref()
            .is_some_and(|d| d.pages.iter().flatten().any(|(_, p, _)| p.slab == slab))
    }

    /// The pages the disk tier holds; for checks.
    #[cfg(test)]
    pub(super) fn demotions_writing_pages(&self) -> Vec<(ClassId, Page)> {
        self.demote
            .as_ref()
            .map(|d| d.pages.iter().flatten().map(|&(c, p, _)| (c, p)).collect())
            .unwrap_or_default()
    }

    /// The chunks handed over since the last call, oldest first.
    pub fn take_demotions(&mut self) -> Vec<Demotion> {
        self.demote
            .as_mut()
            .map(|d| std::mem::take(&mut d.queue))
            .unwrap_or_default()
    }

    /// The disk tier is done with these pages (their chunks written or not): they are free.
    pub fn finish_demotions(&mut self, tickets: &[EntryId]) {
        let Some(d) = self.demote.as_mut() else {
            return;
        };
        let mut unpin = Vec::new();
        for &t in tickets {
            if let Some((id, key, bytes)) = d.taken_back.remove(&t) {
                if d.by_key.get(&key) == Some(&t) {
                    d.by_key.remove(&key);
                }
                d.free_tickets.push(t);
                d.taken_back_bytes -= bytes;
                d.pace.written(bytes, d.held_bytes());
                unpin.push(id);
                continue;
            }
            let Some((class, page, key)) = d.pages.get_mut(t as usize).and_then(Option::take)
            else {
                debug_assert!(false, "a page given back twice");
                continue;
            };
            if d.by_key.get(&key) == Some(&t) {
                d.by_key.remove(&key);
            }
            let bytes = self.pool.page_bytes(class);
            d.free_tickets.push(t);
            d.writing_bytes -= bytes;
            d.pace.written(bytes, d.held_bytes());
            self.pool.free(class, page);
        }
        for id in unpin {
            self.unpin(id);
        }
    }

    /// Takes back into L1 the chunk of `key` if its page is being written (a chunk evicted a
    /// moment ago and asked for again): its page leaves the reserve and is the chunk's again,
    /// a hit as before, pinned until the write that reads it is done. Until then it still
    /// counts against the reserve's room for hand-overs (a drive that writes nothing cannot be
    /// made to hold more than the reserve), and the writes' busy period goes on. Returns its
    /// entry.
    pub(super) fn take_back(&mut self, key: &Key, parent_key: Option<Key>) -> Option<EntryId> {
        if !self.being_written(key) {
            return None;
        }
        let d = self.demote.as_mut()?;
        let &t = d.by_key.get(key)?;
        let (class, page, _) = d.pages.get_mut(t as usize)?.take()?;
        let bytes = self.pool.page_bytes(class);
        // Out of the reserve's free-or-writing pages, still held until its write is done (the
        // drive has not written it: the busy period goes on).
        d.writing_bytes -= bytes;
        d.taken_back_bytes += bytes;
        d.taken_back_count += 1;
        let parent_key =
            parent_key.or_else(|| self.hints.parent_of(key).map(|hash| Key { hash, ..*key }));
        let id = self.insert_entry(*key, class, page, State::Ready, parent_key);
        let d = self.demote.as_mut().expect("checked");
        d.taken_back.insert(t, (id, *key, bytes));
        Some(id)
    }

    /// Whether the page of `key`'s chunk is being written and may be taken back: not while a
    /// store of the same chunk is under way.
    pub(super) fn being_written(&self, key: &Key) -> bool {
        !self.map.contains_key(key)
            && self.demote.as_ref().is_some_and(|d| {
                d.take_back
                    && d.by_key
                        .get(key)
                        .is_some_and(|t| !d.taken_back.contains_key(t))
            })
    }

    /// Lookups leave chunks being written alone: eviction alone, for its test.
    #[cfg(test)]
    pub(super) fn without_take_back(&mut self) {
        if let Some(d) = self.demote.as_mut() {
            d.take_back = false;
        }
    }

    /// Chunks a lookup took back while their pages were being written.
    pub fn demotions_taken_back(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.taken_back_count)
    }

    /// Victims lost to the disk because the pages being written held all of the reserve.
    pub fn demotions_skipped(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.skipped)
    }

    /// Marks the chunks of `keys` that L1 holds as on disk: evicting them later hands nothing to
    /// the write thread, whose queue and the reserve's room are for chunks the disk lacks. The
    /// write thread calls it for those it just wrote (taken back meanwhile, or stored again); a
    /// store of a chunk the disk holds already takes no page at all.
    pub fn known_on_disk(&mut self, keys: &[Key]) {
        for key in keys {
            if let Some(&id) = self.map.get(key) {
                self.entry_mut(id).on_disk = true;
            }
        }
    }

    /// Victims that needed no write, the disk holding them already (filled from it, or stored
    /// again while it held them).
    pub fn evicted_on_disk(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.on_disk)
    }

    /// Victims the policy did not expect to be read again, left unwritten (admission).
    pub fn demotions_not_admitted(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.not_admitted)
    }

    /// Page bytes handed to the disk tier and not yet given back.
    pub fn demotions_writing_bytes(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.writing_bytes)
    }

    /// The reserve kept for the disk tier's writes now ([`super::pace`]).
    pub fn demotion_reserve_bytes(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.pace.bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PolicyKind, Query, StorePlan};
    use super::*;
    use crate::l1::pool::PagePool;

    fn key(hash: u128) -> Key {
        Key {
            fingerprint: 1,
            salt: 0,
            shard: 0,
            hash,
        }
    }

    fn stored(c: &mut Cache, class: crate::l1::pool::ClassId, hash: u128) -> bool {
        match c.begin_store(class, &[key(hash)])[0] {
            StorePlan::Write { entry, .. } => {
                c.finish_store(&[entry], true);
                true
            }
            _ => false,
        }
    }

    fn hashes(d: &[Demotion]) -> Vec<u128> {
        d.iter().map(|d| d.key.hash).collect()
    }

    fn ids(d: &[Demotion]) -> Vec<EntryId> {
        d.iter().map(|d| d.ticket).collect()
    }

    /// `pages` pages of 1 KiB, a reserve of `reserve` of them for the disk tier's writes.
    fn pool(policy: PolicyKind, pages: u64, reserve: u64) -> (Cache, crate::l1::pool::ClassId) {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(pages * 1024, 1024).unwrap()),
            policy,
        );
        let class = c.class_for(1024).unwrap();
        if reserve > 0 {
            let (tx, _rx) = crossbeam_channel::bounded(8);
            c.enable_demotion(reserve * 1024, tx);
        }
        (c, class)
    }

    /// Eight pages of 1 KiB, two of them kept for the disk tier's writes.
    fn demoting(policy: PolicyKind) -> (Cache, crate::l1::pool::ClassId) {
        pool(policy, 8, 2)
    }

    #[test]
    fn victims_go_to_the_disk_at_need_and_stores_take_the_reserve_meanwhile() {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(8 * 1024, 1024).unwrap()),
            PolicyKind::Lru,
        );
        let class = c.class_for(1024).unwrap();
        let (tx, rx) = crossbeam_channel::bounded(1);
        c.enable_demotion(2 * 1024, tx);
        // Six stores fill L1: the last two pages are the reserve for the disk tier's writes.
        for h in 0..6 {
            assert!(stored(&mut c, class, h));
        }
        assert!(c.take_demotions().is_empty());
        assert_eq!(c.stats().usage.free_bytes, 2 * 1024);
        assert_eq!(c.stats().counters.evictions, 0);
        // The seventh evicts the oldest, as it would without a disk tier; its page goes to the
        // disk tier and the store takes a page of the reserve.
        assert!(stored(&mut c, class, 6));
        c.check_invariants();
        let d = c.take_demotions();
        assert_eq!(hashes(&d), vec![0]);
        assert!(rx.try_recv().is_ok(), "the disk tier was woken");
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 0, "evicted: out of L1");
        assert_eq!(c.stats().disk_writing_bytes, 1024);
        // The next takes the last free page the same way: the reserve is all being written.
        assert!(stored(&mut c, class, 7));
        let d2 = c.take_demotions();
        assert_eq!(hashes(&d2), vec![1]);
        assert_eq!(c.stats().usage.free_bytes, 0);
        // Then a victim is lost to the disk, as it would be without one, and its page taken.
        assert!(stored(&mut c, class, 8));
        assert!(c.take_demotions().is_empty());
        assert_eq!(c.demotions_skipped(), 1);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[2]), 0);
        c.check_invariants();
        // Written: the pages are free again, for the next victims' writes.
        c.finish_demotions(&[d[0].ticket, d2[0].ticket]);
        c.check_invariants();
        assert_eq!(c.stats().disk_writing_bytes, 0);
        assert_eq!(c.stats().usage.free_bytes, 2 * 1024);
        assert!(stored(&mut c, class, 9));
        assert_eq!(hashes(&c.take_demotions()), vec![3]);
        // One victim per store throughout, and L1 held six chunks: the pool less the reserve.
        assert_eq!(c.stats().counters.evictions, 4);
        assert_eq!(c.stats().entries, 6);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[4, 5, 6, 7, 8, 9]), 6);
        c.check_invariants();
    }

    /// A chunk evicted a moment ago and asked for again while its page is being written is
    /// taken back: a hit from the same page, out of the reserve, and kept (pinned) until the
    /// write that reads the page is done; the page is then the chunk's, not freed.
    #[test]
    fn a_lookup_takes_back_a_chunk_whose_page_is_being_written() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        let now = tokio::time::Instant::now();
        let ttl = std::time::Duration::from_secs(1);
        for h in 0..7 {
            assert!(stored(&mut c, class, h));
        }
        let d = c.take_demotions();
        assert_eq!(hashes(&d), vec![0]);
        assert_eq!(c.stats().disk_writing_bytes, 1024);
        // The tiers below need not fetch it: a lookup would take it back.
        assert_eq!(c.available_prefix(1, 0, &[0], &[0, 1]), 2);
        // Asked for again: a hit, its page now L1's again, and the reserve short of it.
        let q = Query::prefix(1, 0, &[0], &[0, 1]);
        assert_eq!(c.lookup(1, &q, now, ttl).0, 2);
        assert_eq!(c.demotions_taken_back(), 1);
        assert_eq!(c.stats().disk_writing_bytes, 0);
        assert_eq!(c.stats().entries, 7);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 1);
        let plan = c.begin_retrieve(class, &[key(0)], true)[0].expect("ready");
        assert_eq!(plan.offset, d[0].offset, "the same page");
        c.finish_retrieve(&[plan.entry], None);
        c.check_invariants();
        // Taken back once: the next lookup finds it as any chunk.
        assert_eq!(c.lookup(1, &q, now, ttl).0, 2);
        assert_eq!(c.demotions_taken_back(), 1);
        // While the write still reads its page, stores never evict it.
        for h in 7..12 {
            assert!(stored(&mut c, class, h));
        }
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 1, "pinned for the write");
        c.check_invariants();
        // The write done, the page stays the chunk's: nothing is freed.
        let free = c.stats().usage.free_bytes;
        c.finish_demotions(&ids(&d));
        assert_eq!(c.stats().usage.free_bytes, free);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 1);
        c.check_invariants();
        // The write thread says it is on disk now.
        c.known_on_disk(&[key(0)]);
        // And it is evictable again, as the most recently used, leaving without a write.
        let mut handed = Vec::new();
        let mut settle = |c: &mut Cache| {
            let d = c.take_demotions();
            handed.extend(hashes(&d));
            c.finish_demotions(&ids(&d));
        };
        settle(&mut c);
        for h in 12..18 {
            assert!(stored(&mut c, class, h));
            settle(&mut c);
        }
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 0);
        assert!(!handed.contains(&0), "handed over again: {handed:?}");
        assert_eq!(c.evicted_on_disk(), 1);
        c.check_invariants();
    }

    /// While the pool is still being pinned, the reserve is in proportion to its ready part: a
    /// store that would rather wait for the pool's growth than evict takes the pages that are
    /// ready instead of waiting for the whole reserve.
    #[test]
    fn a_growing_pool_keeps_a_reserve_in_proportion_to_its_ready_part() {
        let mut c = Cache::new(
            PagePool::growing(&kvd_gpu::PoolLayout::new(8 * 1024, 1024).unwrap()),
            PolicyKind::Lru,
        );
        c.grow_pool(4);
        let class = c.class_for(1024).unwrap();
        let (tx, _rx) = crossbeam_channel::bounded(8);
        c.enable_demotion(2 * 1024, tx);
        // Whether each store (one that would rather wait for growth than evict) got a page.
        let took = |c: &mut Cache, hs: std::ops::Range<u128>| -> Vec<bool> {
            hs.map(|h| {
                let plan = c.begin_store_with(class, &[key(h)], None, false)[0];
                matches!(plan, StorePlan::Write { .. })
            })
            .collect()
        };
        // Half the pool is ready: the reserve is half of two pages, so three of the four ready
        // pages can be had (two, with the whole reserve kept back).
        assert_eq!(took(&mut c, 0..4), [true, true, true, false]);
        // All of it ready: the whole reserve is kept back, and L1 takes six of the eight.
        c.grow_pool(8);
        assert_eq!(took(&mut c, 3..8), [true, true, true, false, false]);
        c.check_invariants();
    }

    /// The disk tier's eviction costs L1 only its reserve: on the same traffic a cache with a
    /// disk tier (victims written with random delays) keeps what a cache without one keeps in
    /// a pool smaller by the reserve, lookup for lookup. Lookups taking chunks back from the
    /// writes ([`Cache::take_back`]) are left out of that comparison (they add hits L1 alone
    /// would not have); over the same traffic they add hits in all (a chunk taken back leaves
    /// the reserve short, so a later store evicts once more: a single lookup may lose one).
    #[test]
    fn l1_keeps_what_a_pool_smaller_by_the_reserve_keeps_without_a_disk() {
        for policy in [
            PolicyKind::Lru,
            PolicyKind::S3Fifo,
            PolicyKind::Prefix,
            PolicyKind::Fifo,
            PolicyKind::PrefixReuse,
        ] {
            let (mut disk, class) = pool(policy, 64, 8);
            disk.without_take_back();
            let (mut plain, pclass) = pool(policy, 56, 0);
            let (mut back, bclass) = pool(policy, 64, 8);
            let (mut hits, mut hits_back) = (0, 0);
            let mut writing_back: Vec<EntryId> = Vec::new();
            let now = tokio::time::Instant::now();
            let ttl = std::time::Duration::from_secs(60);
            let mut rng = 0x2545_f491_4f6c_dd1d_u64;
            let mut next = move |n: u64| {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng % n
            };
            let mut writing: Vec<EntryId> = Vec::new();
            let mut written = 0;
            for step in 0..4_000 {
                // A conversation's prompt: its chunks so far, one more each turn.
                let conv = next(24) as u128;
                let len = 1 + next(12) as u128;
                let chunks: Vec<u128> = (0..len).map(|i| conv * 1_000 + i).collect();
                let q = Query::prefix(1, 0, &[0], &chunks);
                let (hit, _) = disk.lookup(1, &q, now, ttl);
                let (want, _) = plain.lookup(1, &q, now, ttl);
                assert_eq!(hit, want, "{policy:?}, step {step}: hits differ");
                let (hit_back, _) = back.lookup(1, &q, now, ttl);
                (hits, hits_back) = (hits + hit, hits_back + hit_back);
                let keys: Vec<Key> = chunks[hit as usize..].iter().map(|&h| key(h)).collect();
                let keys_back: Vec<Key> = chunks[hit_back as usize..]
                    .iter()
                    .map(|&h| key(h))
                    .collect();
                for (c, class, keys) in [
                    (&mut disk, class, &keys),
                    (&mut plain, pclass, &keys),
                    (&mut back, bclass, &keys_back),
                ] {
                    let ids: Vec<EntryId> = c
                        .begin_store(class, keys)
                        .into_iter()
                        .filter_map(|p| match p {
                            StorePlan::Write { entry, .. } => Some(entry),
                            _ => None,
                        })
                        .collect();
                    c.finish_store(&ids, true);
                }
                writing.extend(ids(&disk.take_demotions()));
                writing_back.extend(ids(&back.take_demotions()));
                // The drive finishes some of the writes, oldest first.
                let done = next(writing.len() as u64 + 1) as usize;
                written += done;
                disk.finish_demotions(&writing.drain(..done).collect::<Vec<_>>());
                let done = next(writing_back.len() as u64 + 1) as usize;
                back.finish_demotions(&writing_back.drain(..done).collect::<Vec<_>>());
                if step % 500 == 0 {
                    disk.check_invariants();
                    plain.check_invariants();
                    back.check_invariants();
                }
            }
            assert!(
                back.demotions_taken_back() > 0 && hits_back > hits,
                "{policy:?}: {} taken back, hits {hits_back} against {hits}",
                back.demotions_taken_back()
            );
            assert!(written > 100, "{policy:?}: the disk tier wrote {written}");
            assert!(disk.stats().counters.evictions > 1_000);
            assert_eq!(
                disk.stats().counters.evictions,
                plain.stats().counters.evictions
            );
        }
    }

    /// Admission: a victim eviction expects no read of (here on probation: stored by key, never
    /// asked for or read) is not written: it is lost as it would be without a disk tier. A
    /// victim a lookup asked for is written.
    #[test]
    fn only_victims_likely_to_be_read_again_are_written() {
        let (mut c, class) = demoting(PolicyKind::PrefixReuse);
        let now = tokio::time::Instant::now();
        let ttl = std::time::Duration::from_secs(1);
        // Chunks 100 and 101 are asked for (a miss) before they are stored, as vLLM does.
        assert_eq!(
            c.lookup(1, &Query::prefix(1, 0, &[0], &[100, 101]), now, ttl)
                .0,
            0
        );
        for h in [100, 101] {
            assert!(stored(&mut c, class, h));
        }
        // Five chunks stored by key: on probation, the first victims. The fifth finds L1 full
        // and evicts the oldest of them, unwritten.
        for h in 0..5 {
            assert!(stored(&mut c, class, h));
        }
        assert!(c.take_demotions().is_empty(), "nothing written");
        assert_eq!(c.demotions_not_admitted(), 1);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 0);
        c.check_invariants();
        // Chunks asked for before they are stored push out the rest on probation, unwritten;
        // once only chunks asked for are left to evict, those are written.
        let asked: Vec<u128> = (7..13).collect();
        assert_eq!(
            c.lookup(1, &Query::prefix(1, 0, &[0], &asked), now, ttl).0,
            0
        );
        for &h in &asked {
            assert!(stored(&mut c, class, h));
        }
        let written = hashes(&c.take_demotions());
        assert!(
            !written.is_empty(),
            "victims that will be read again are written"
        );
        assert!(
            written.iter().all(|h| !(0..7).contains(h)),
            "only chunks asked for are written: {written:?}"
        );
        assert_eq!(
            c.demotions_not_admitted(),
            5,
            "every chunk on probation went unwritten"
        );
        c.check_invariants();
    }

    fn filled(c: &mut Cache, class: crate::l1::pool::ClassId, hash: u128) -> bool {
        match c.begin_fill(class, &[key(hash)])[0] {
            StorePlan::Write { entry, .. } => {
                c.finish_store(&[entry], true);
                true
            }
            StorePlan::Refused => false,
            p => panic!("unexpected plan {p:?}"),
        }
    }

    /// A fill stands in for the store the request would make after recomputing the chunks: it
    /// evicts what that store would, and the victim goes to the disk as any other.
    #[test]
    fn a_fill_evicts_as_a_store_would_and_its_victim_goes_to_the_disk() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        for h in 0..6 {
            assert!(stored(&mut c, class, h));
        }
        assert!(filled(&mut c, class, 100));
        assert_eq!(hashes(&c.take_demotions()), vec![0]);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[100]), 1);
        let n = c.stats().counters;
        assert_eq!(
            (n.store_refusals, n.refused_pinned, n.refused_no_pages),
            (0, 0, 0)
        );
        c.check_invariants();
    }

    #[test]
    fn chunks_filled_from_the_disk_leave_without_a_write() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        // The two oldest chunks came from the disk.
        assert!(filled(&mut c, class, 100));
        assert!(filled(&mut c, class, 101));
        for h in 0..4 {
            assert!(stored(&mut c, class, h));
        }
        // L1 is full; the next two stores evict the filled chunks: freed, nothing to write.
        assert!(stored(&mut c, class, 4));
        assert!(stored(&mut c, class, 5));
        assert!(c.take_demotions().is_empty());
        assert_eq!(c.evicted_on_disk(), 2);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[100]), 0);
        assert_eq!(c.stats().usage.free_bytes, 2 * 1024, "the reserve is whole");
        // The next victim was stored, not filled: it goes to the disk tier.
        assert!(stored(&mut c, class, 6));
        assert_eq!(hashes(&c.take_demotions()), vec![0]);
        c.check_invariants();
    }

    /// A chunk stored again while the disk holds it (recomputed after its write) is marked
    /// so: it leaves without a write and takes none of the reserve.
    #[test]
    fn chunks_stored_again_while_on_disk_leave_without_a_write() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        for h in 0..2 {
            match c.begin_store(class, &[key(h)])[0] {
                StorePlan::Write { entry, .. } => {
                    c.known_on_disk(&[key(h)]);
                    c.finish_store(&[entry], true);
                }
                p => panic!("unexpected plan {p:?}"),
            }
        }
        for h in 2..6 {
            assert!(stored(&mut c, class, h));
        }
        assert!(stored(&mut c, class, 6));
        assert!(stored(&mut c, class, 7));
        assert!(c.take_demotions().is_empty());
        assert_eq!(c.evicted_on_disk(), 2);
        assert_eq!(c.stats().usage.free_bytes, 2 * 1024, "the reserve is whole");
        assert!(stored(&mut c, class, 8));
        assert_eq!(hashes(&c.take_demotions()), vec![2]);
        c.check_invariants();
    }

    fn stored_request(c: &mut Cache, class: crate::l1::pool::ClassId, hashes: &[u128]) {
        let keys: Vec<Key> = hashes.iter().map(|&h| key(h)).collect();
        let ids: Vec<EntryId> = c
            .begin_store(class, &keys)
            .into_iter()
            .map(|p| match p {
                StorePlan::Write { entry, .. } => entry,
                p => panic!("unexpected plan {p:?}"),
            })
            .collect();
        c.finish_store(&ids, true);
    }

    #[test]
    fn a_prefix_goes_to_the_disk_tail_first() {
        let (mut c, class) = demoting(PolicyKind::Prefix);
        // Two conversations of three chunks; A is the older.
        stored_request(&mut c, class, &[10, 11, 12]);
        stored_request(&mut c, class, &[20, 21, 22]);
        // Two more stores: A's tail goes to the disk, then the chunk before it, now a leaf,
        // not B's tail.
        assert!(stored(&mut c, class, 30));
        assert!(stored(&mut c, class, 31));
        assert_eq!(hashes(&c.take_demotions()), vec![12, 11]);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[10, 11, 12]), 1);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[20, 21, 22]), 3);
        c.check_invariants();
    }

    /// The page of a chunk being written stays as it is until the disk tier is done with it:
    /// no store or fill is given it.
    #[test]
    fn a_page_being_written_is_handed_out_again_only_when_the_disk_tier_is_done() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        for h in 0..7 {
            assert!(stored(&mut c, class, h));
        }
        let d = c.take_demotions();
        assert_eq!(hashes(&d), vec![0]);
        let mut offsets = Vec::new();
        for h in 10..40 {
            let plans = if h % 2 == 0 {
                c.begin_store(class, &[key(h)])
            } else {
                c.begin_fill(class, &[key(h)])
            };
            if let StorePlan::Write { entry, offset } = plans[0] {
                offsets.push(offset);
                c.finish_store(&[entry], true);
            }
            let later = c.take_demotions();
            c.finish_demotions(&ids(&later));
        }
        assert_eq!(offsets.len(), 30);
        assert!(
            !offsets.contains(&d[0].offset),
            "a page being written was reused"
        );
        c.check_invariants();
        c.finish_demotions(&[d[0].ticket]);
        c.check_invariants();
        assert!(stored(&mut c, class, 50));
        assert!(stored(&mut c, class, 51));
        assert_eq!(c.stats().entries, 6);
    }

    #[test]
    fn chunks_being_filled_are_reported_and_pinned_and_a_failed_one_leaves_at_the_last_unpin() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        assert!(stored(&mut c, class, 0));
        assert!(stored(&mut c, class, 1));
        let ids: Vec<EntryId> = c
            .begin_fill(class, &[key(2), key(3)])
            .into_iter()
            .map(|p| match p {
                StorePlan::Write { entry, .. } => entry,
                p => panic!("unexpected plan {p:?}"),
            })
            .collect();
        let hashes = [0, 1, 2, 3];
        assert!(c.filling(&[key(0), key(3)]));
        assert!(!c.filling(&[key(0), key(1)]));
        assert_eq!(c.ready_prefix(1, 0, &[0], &hashes), 2);
        assert_eq!(c.available_prefix(1, 0, &[0], &hashes), 4);
        // A lookup reports and pins all four; no retrieve reads a page still being filled.
        let now = tokio::time::Instant::now();
        let ttl = std::time::Duration::from_secs(60);
        let (hit, pin) = c.lookup(7, &Query::prefix(1, 0, &[0], &hashes).pinned(1), now, ttl);
        assert_eq!(hit, 4);
        assert_ne!(pin, 0);
        assert!(c.begin_retrieve(class, &[key(2)], false)[0].is_none());
        c.check_invariants();
        // Chunk 2 comes back intact, chunk 3 fails its check.
        c.finish_store(&[ids[0]], true);
        c.finish_store(&[ids[1]], false);
        c.check_invariants();
        assert!(!c.filling(&[key(2), key(3)]));
        assert_eq!(c.available_prefix(1, 0, &[0], &hashes), 3);
        assert!(
            c.begin_retrieve(class, &[key(3)], false)[0].is_none(),
            "never delivered"
        );
        // The failed chunk's page stays until the lookup's pin goes; its key may be stored
        // again meanwhile, into another page.
        assert_eq!(c.stats().usage.used_bytes, 4 * 1024);
        assert!(stored(&mut c, class, 3));
        c.check_invariants();
        assert_eq!(c.stats().usage.used_bytes, 5 * 1024);
        assert_eq!(c.release(pin), 4);
        c.check_invariants();
        assert_eq!(c.stats().usage.used_bytes, 4 * 1024);
        assert_eq!(c.stats().pinned_pages, 0);
        assert_eq!(c.ready_prefix(1, 0, &[0], &hashes), 4);
    }

    /// A drive that writes nothing while every chunk it is handed is asked for again: the
    /// chunks taken back stay held until their writes are done, so they count against the
    /// reserve's room with those being written, and the write thread never holds more than
    /// the reserve (else it would pin the whole pool and stores would be refused).
    #[test]
    fn chunks_taken_back_count_against_the_reserve_until_written() {
        let (mut c, class) = pool(PolicyKind::Lru, 16, 2);
        let now = tokio::time::Instant::now();
        let ttl = std::time::Duration::from_secs(1);
        for h in 0..14 {
            assert!(stored(&mut c, class, h));
        }
        let mut tickets = Vec::new();
        for h in 100..140u128 {
            assert!(stored(&mut c, class, h), "store {h} refused");
            for d in c.take_demotions() {
                tickets.push(d.ticket);
                let q = Query::prefix(1, 0, &[0], std::slice::from_ref(&d.key.hash));
                assert_eq!(c.lookup(1, &q, now, ttl).0, 1);
            }
            c.check_invariants();
        }
        assert_eq!(
            tickets.len(),
            2,
            "the write thread holds the reserve, no more"
        );
        assert_eq!(c.demotions_taken_back(), 2);
        assert_eq!(c.stats().pinned_pages, 2);
        c.finish_demotions(&tickets);
        assert_eq!(c.stats().pinned_pages, 0);
        c.check_invariants();
    }

    /// Taking a chunk back is not the drive writing it: a burst's busy period goes on until
    /// the writes of the chunks taken back are done, and the paced reserve does not grow for
    /// a drive that wrote nothing.
    #[test]
    fn taking_back_does_not_end_a_busy_period() {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(64 * 1024, 1024).unwrap()),
            PolicyKind::Lru,
        );
        let class = c.class_for(1024).unwrap();
        let (tx, _rx) = crossbeam_channel::bounded(8);
        c.enable_paced_demotion(2 * 1024, 8 * 1024, tx);
        let now = tokio::time::Instant::now();
        let ttl = std::time::Duration::from_secs(1);
        for h in 0..62 {
            assert!(stored(&mut c, class, h));
        }
        let mut tickets = Vec::new();
        for round in 0..5u128 {
            for h in 0..10 {
                assert!(stored(&mut c, class, 1000 * (round + 1) + h));
            }
            for d in c.take_demotions() {
                tickets.push(d.ticket);
                let q = Query::prefix(1, 0, &[0], std::slice::from_ref(&d.key.hash));
                assert_eq!(c.lookup(1, &q, now, ttl).0, 1);
            }
        }
        assert!(c.demotions_skipped() > 0);
        assert_eq!(
            c.demotion_reserve_bytes(),
            2 * 1024,
            "grew with nothing written"
        );
        // The drive writes them: the burst it caught up with grows the reserve.
        c.finish_demotions(&tickets);
        assert_eq!(c.demotion_reserve_bytes(), 8 * 1024);
        c.check_invariants();
    }
}
