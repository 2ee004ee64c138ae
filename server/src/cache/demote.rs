//! Write-on-evict for the disk tier, cleaning ahead. A store must get its page at once, so a
//! chunk cannot wait for a disk write at the moment it is evicted. Instead, with a disk tier,
//! whenever an allocation leaves fewer than `cap` bytes free (free pages plus pages on their
//! way out), the next victim is handed to the disk tier: it leaves the index (no longer an L1
//! hit; its key may be stored again) and becomes `Demoting`, its page held and pinned — so no
//! slab holding it changes class — until the write thread has copied it out (about a
//! millisecond) and calls [`Cache::finish_demotions`]; then the page is free for the next
//! store. So chunks reach the disk as they leave DRAM, not on every store, and stores keep
//! finding free pages.
//!
//! `cap` is `--disk-write-queue-mb` (at most an eighth of the pool; in proportion to its ready
//! part while a large pool is still being pinned after start). When the disk falls that
//! far behind, allocations evict as they do without a disk tier; those chunks are lost to the
//! disk too, and counted ([`Cache::demotions_skipped`]).
//!
//! A chunk filled from the disk ([`Cache::begin_fill`]) is still there: evicting it frees its
//! page at once, with no write and no place in the queue ([`Cache::evicted_on_disk`]). (If
//! the disk's log has wrapped over it since, it is lost as any chunk the log drops.)

use crossbeam_channel::Sender;

use super::{Cache, EntryId, Key, State};

/// An evicted chunk for the disk tier to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demotion {
    /// Its entry, held until [`Cache::finish_demotions`].
    pub entry: EntryId,
    /// Its key.
    pub key: Key,
    /// Its page's byte offset in the pool.
    pub offset: u64,
    /// Its page's size.
    pub page_bytes: u64,
}

/// The queue of evicted chunks waiting for the disk tier.
#[derive(Debug)]
pub(super) struct Demoter {
    cap_bytes: u64,
    held_bytes: u64,
    queue: Vec<Demotion>,
    kick: Sender<()>,
    skipped: u64,
    on_disk: u64,
}

impl Cache {
    /// Makes eviction hand victims to the disk tier, holding at most `cap_bytes` of pages for
    /// it; `kick` gets a token whenever the queue gains one.
    pub fn enable_demotion(&mut self, cap_bytes: u64, kick: Sender<()>) {
        self.demote = Some(Demoter {
            cap_bytes,
            held_bytes: 0,
            queue: Vec::new(),
            kick,
            skipped: 0,
            on_disk: 0,
        });
    }

    /// Demotes victims of `class` until free pages and pages on their way out make `cap`.
    pub(super) fn clean_ahead(&mut self, class: super::ClassId) {
        loop {
            let Some(d) = self.demote.as_ref() else {
                return;
            };
            // In proportion to the part of the pool that is ready: while a large pool is still
            // being pinned, cleaning ahead for the whole of it would empty what is ready.
            let (ready, total) = (self.pool.capacity_bytes(), self.pool.total_bytes().max(1));
            let cap = (u128::from(d.cap_bytes) * u128::from(ready) / u128::from(total)) as u64;
            if self.pool.usage().free_bytes + d.held_bytes >= cap {
                return;
            }
            let Some(victim) = self.policies[class.0 as usize].peek_victim() else {
                return;
            };
            if self.entry(victim).on_disk {
                // The disk has it already: its page is free now, no write needed.
                self.remove(victim);
                self.counters.evictions += 1;
                self.note_evicted(true);
                continue;
            }
            if !self.demote_one(victim) {
                return;
            }
            self.counters.evictions += 1;
        }
    }

    /// Counts a victim freed without the write queue: one the disk holds already (filled from
    /// it), or one lost to the disk because the disk tier fell behind.
    pub(super) fn note_evicted(&mut self, on_disk: bool) {
        if let Some(d) = self.demote.as_mut() {
            if on_disk {
                d.on_disk += 1;
            } else {
                d.skipped += 1;
            }
        }
    }

    /// Hands one victim to the disk tier; false when the held pages are at their cap.
    fn demote_one(&mut self, id: EntryId) -> bool {
        let (class, page, key) = {
            let e = self.entry(id);
            (e.class, e.page, e.key)
        };
        let bytes = self.pool.page_bytes(class);
        let offset = self.pool.offset(class, page);
        let Some(d) = self.demote.as_mut() else {
            return false;
        };
        if d.held_bytes + bytes > d.cap_bytes {
            return false;
        }
        d.held_bytes += bytes;
        d.queue.push(Demotion {
            entry: id,
            key,
            offset,
            page_bytes: bytes,
        });
        let _ = d.kick.try_send(());
        // Pinned, so its slab stays; evicted in every other way. Out of the prefix tree too:
        // its parent is a leaf again and may be the next victim (a prefix leaves tail first
        // here as without a disk), and a store of its key meanwhile starts afresh.
        self.pin(id);
        self.unindex(id);
        self.entry_mut(id).state = State::Demoting;
        true
    }

    /// The chunks evicted since the last call, oldest first.
    pub fn take_demotions(&mut self) -> Vec<Demotion> {
        self.demote
            .as_mut()
            .map(|d| std::mem::take(&mut d.queue))
            .unwrap_or_default()
    }

    /// The disk tier is done with these chunks (written or not): their pages are free.
    pub fn finish_demotions(&mut self, entries: &[EntryId]) {
        for &id in entries {
            let class = self.entry(id).class;
            let bytes = self.pool.page_bytes(class);
            let e = self.entry_mut(id);
            debug_assert_eq!(e.state, State::Demoting);
            e.pins -= 1;
            self.pinned_pages -= 1;
            if let Some(d) = self.demote.as_mut() {
                d.held_bytes -= bytes;
            }
            self.free_page(id);
        }
    }

    /// Victims freed without a disk write because the held pages were at their cap.
    pub fn demotions_skipped(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.skipped)
    }

    /// Victims freed without a disk write because the disk holds them already (they were
    /// filled from it, [`Cache::begin_fill`]).
    pub fn evicted_on_disk(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.on_disk)
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PolicyKind, StorePlan};
    use super::*;
    use crate::pool::PagePool;

    fn key(hash: u128) -> Key {
        Key {
            fingerprint: 1,
            salt: 0,
            shard: 0,
            hash,
        }
    }

    fn stored(c: &mut Cache, class: crate::pool::ClassId, hash: u128) -> bool {
        match c.begin_store(class, &[key(hash)])[0] {
            StorePlan::Write { entry, .. } => {
                c.finish_store(&[entry], true);
                true
            }
            _ => false,
        }
    }

    #[test]
    fn chunks_leave_for_the_disk_ahead_of_need_and_keep_their_page_until_copied() {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(8 * 1024, 1024).unwrap()),
            PolicyKind::Lru,
        );
        let class = c.class_for(1024).unwrap();
        let (tx, rx) = crossbeam_channel::bounded(1);
        c.enable_demotion(2 * 1024, tx);
        // Six stores leave two pages free: nothing needs to leave yet.
        for h in 0..6 {
            assert!(stored(&mut c, class, h));
        }
        assert!(c.take_demotions().is_empty());
        // The seventh leaves one free page: the oldest chunk goes to the disk.
        assert!(stored(&mut c, class, 6));
        c.check_invariants();
        let d = c.take_demotions();
        assert_eq!(d.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![0]);
        assert!(rx.try_recv().is_ok(), "the disk tier was woken");
        assert_eq!(
            c.ready_prefix(1, 0, &[0], &[0]),
            0,
            "a demoting chunk is no L1 hit"
        );
        // The last free page: the next oldest leaves too, the cap is reached.
        assert!(stored(&mut c, class, 7));
        let d2 = c.take_demotions();
        assert_eq!(d2.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![1]);
        // No free page and the cap reached: a store evicts as without a disk tier.
        assert!(stored(&mut c, class, 8));
        assert_eq!(c.demotions_skipped(), 1);
        assert_eq!(
            c.ready_prefix(1, 0, &[0], &[2]),
            0,
            "chunk 2 was freed unwritten"
        );
        c.check_invariants();
        // A key may be stored anew while its old page is still on its way out.
        assert!(stored(&mut c, class, 0));
        c.check_invariants();
        // Once copied out, the pages are free again; the newer entry stays.
        c.finish_demotions(&[d[0].entry, d2[0].entry]);
        c.check_invariants();
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 1);
        assert_eq!(c.stats().usage.free_bytes, 2 * 1024);
    }

    /// Eight pages of 1 KiB, two of them cleaned ahead for the disk.
    fn demoting(policy: PolicyKind) -> (Cache, crate::pool::ClassId) {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(8 * 1024, 1024).unwrap()),
            policy,
        );
        let class = c.class_for(1024).unwrap();
        let (tx, _rx) = crossbeam_channel::bounded(8);
        c.enable_demotion(2 * 1024, tx);
        (c, class)
    }

    fn filled(c: &mut Cache, class: crate::pool::ClassId, hash: u128) -> bool {
        match c.begin_fill(class, &[key(hash)])[0] {
            StorePlan::Write { entry, .. } => {
                c.finish_store(&[entry], true);
                true
            }
            StorePlan::Refused => false,
            p => panic!("unexpected plan {p:?}"),
        }
    }

    #[test]
    fn a_fill_takes_only_free_pages_and_never_drops_an_unwritten_chunk() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        for h in 0..8 {
            assert!(stored(&mut c, class, h));
        }
        // Full: two chunks on their way to the disk, none free.
        let out = c.take_demotions();
        assert_eq!(out.len(), 2);
        assert_eq!(c.stats().usage.free_bytes, 0);
        // A fill finds no free page: refused, nothing evicted, no store refusal counted.
        assert!(!filled(&mut c, class, 100));
        assert_eq!(c.demotions_skipped(), 0, "no chunk was dropped for a fill");
        for h in 2..8 {
            assert_eq!(
                c.ready_prefix(1, 0, &[0], &[h]),
                1,
                "chunk {h} is still a hit"
            );
        }
        let n = c.stats().counters;
        assert_eq!(
            (n.store_refusals, n.refused_pinned, n.refused_no_pages),
            (0, 0, 0)
        );
        // Once the disk has the two, the fill gets their pages.
        c.finish_demotions(&out.iter().map(|d| d.entry).collect::<Vec<_>>());
        assert!(filled(&mut c, class, 100));
        assert_eq!(c.ready_prefix(1, 0, &[0], &[100]), 1);
        c.check_invariants();
    }

    #[test]
    fn chunks_filled_from_the_disk_leave_without_a_write() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        // The two oldest chunks came from the disk.
        assert!(filled(&mut c, class, 100));
        assert!(filled(&mut c, class, 101));
        for h in 0..6 {
            assert!(stored(&mut c, class, h));
        }
        // Cleaning ahead took the two filled chunks: freed at once, nothing to write.
        assert!(c.take_demotions().is_empty());
        assert_eq!(c.evicted_on_disk(), 2);
        assert_eq!(c.stats().usage.free_bytes, 2 * 1024);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[100]), 0);
        // The next victim was stored, not filled: it goes through the queue.
        assert!(stored(&mut c, class, 6));
        let d = c.take_demotions();
        assert_eq!(d.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![0]);
        assert_eq!(c.evicted_on_disk(), 2);
        c.check_invariants();
    }

    fn stored_request(c: &mut Cache, class: crate::pool::ClassId, hashes: &[u128]) {
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
    fn a_prefix_leaves_for_the_disk_tail_first_as_it_leaves_without_one() {
        let (mut c, class) = demoting(PolicyKind::Prefix);
        // Two conversations of three chunks; A is the older.
        stored_request(&mut c, class, &[10, 11, 12]);
        stored_request(&mut c, class, &[20, 21, 22]);
        // Two more stores: two chunks leave for the disk. A's tail goes first, and then the
        // chunk before it (a leaf again) rather than B's tail.
        assert!(stored(&mut c, class, 30));
        assert!(stored(&mut c, class, 31));
        let d = c.take_demotions();
        assert_eq!(
            d.iter().map(|d| d.key.hash).collect::<Vec<_>>(),
            vec![12, 11]
        );
        assert_eq!(c.ready_prefix(1, 0, &[0], &[20, 21, 22]), 3);
        c.check_invariants();
    }

    #[test]
    fn a_key_stored_again_while_its_old_page_is_written_keeps_its_children() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        // LRU takes the head of a request while its tail stays.
        stored_request(&mut c, class, &[10, 11, 12]);
        for h in 0..4 {
            assert!(stored(&mut c, class, h));
        }
        let mut d = c.take_demotions();
        assert_eq!(d.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![10]);
        // The tail is read: the next to leave is chunk 0.
        let now = tokio::time::Instant::now();
        let ttl = std::time::Duration::from_secs(1);
        assert_eq!(c.lookup(1, 1, 0, &[0], &[11, 12], false, 1, now, ttl).0, 2);
        // The head is stored again before the disk is done with the old page: the tail hangs
        // from the new entry, and stays there once the old page is freed.
        assert!(stored(&mut c, class, 10));
        d.extend(c.take_demotions());
        c.check_invariants();
        assert_eq!(c.stats().unreachable_chunks, 0);
        c.finish_demotions(&d.iter().map(|d| d.entry).collect::<Vec<_>>());
        c.check_invariants();
        assert_eq!(c.stats().unreachable_chunks, 0);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[10, 11, 12]), 3);
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
        let (hit, pin) = c.lookup(7, 1, 0, &[0], &hashes, true, 1, now, ttl);
        assert_eq!(hit, 4);
        assert_ne!(pin, 0);
        assert!(c.begin_retrieve(class, &[key(2)])[0].is_none());
        c.check_invariants();
        // Chunk 2 comes back intact, chunk 3 fails its check.
        c.finish_store(&[ids[0]], true);
        c.finish_store(&[ids[1]], false);
        c.check_invariants();
        assert!(!c.filling(&[key(2), key(3)]));
        assert_eq!(c.available_prefix(1, 0, &[0], &hashes), 3);
        assert!(
            c.begin_retrieve(class, &[key(3)])[0].is_none(),
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
}
