//! Write-back ahead for the disk tier. A store must get its page at once, so a chunk cannot
//! wait for a disk write at the moment it is evicted. Instead, with a disk tier, whenever an
//! allocation leaves fewer than `cap` bytes that could be had at once — free pages, pages
//! whose chunks the disk holds too ("clean"), and pages being written — the next victim is
//! handed to the disk tier's write thread. It stays in L1, a hit like any other, pinned while
//! the thread writes its page in place (so no slab holding it changes class); once written
//! ([`Cache::finish_demotions`]) it is clean, next in line to go: the next allocation that
//! finds no free page takes a clean page first, and freeing it loses nothing. A lookup that
//! hits a clean chunk puts it back among the others (still on disk: when it is the victim
//! again, no write). So chunks reach the disk before they leave DRAM, not on every store, and
//! stores keep finding pages at once. The margin is not free: its victims are chosen up to
//! `cap` ahead of need, and replaying live traffic through the cache alone, `prefix-reuse`
//! lost 3.8% of its hits to it on average (benches/results/2026-12-04-session-13.md).
//!
//! Admission: a victim the policy does not expect to be read again
//! ([`crate::l1::evict::EvictionPolicy::likely_read_again`]) is not written. It joins the clean
//! pages as it is, still a hit until its page is needed, and is then lost as it would be without
//! a disk tier ([`Cache::demotions_not_admitted`]).
//!
//! `cap` is `--disk-write-queue-mb` (at most an eighth of the pool; in proportion to its ready
//! part while a large pool is still being pinned after start). When the disk falls that far
//! behind, allocations evict as they do without a disk tier; those chunks are lost to the
//! disk, and counted ([`Cache::demotions_skipped`]).
//!
//! A chunk filled from the disk ([`Cache::begin_fill`]) is still there: when it is the victim
//! it is clean at once, with no write ([`Cache::evicted_on_disk`] counts such victims). (If
//! the disk's log has wrapped over it since, it is lost as any chunk the log drops.)

use crossbeam_channel::Sender;

use super::{Cache, EntryId, Key, State};

/// A chunk for the disk tier to write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demotion {
    /// Its entry, pinned until [`Cache::finish_demotions`].
    pub entry: EntryId,
    /// Its key.
    pub key: Key,
    /// Its page's byte offset in the pool.
    pub offset: u64,
    /// Its page's size.
    pub page_bytes: u64,
}

/// The queue of chunks waiting for the disk tier.
#[derive(Debug)]
pub(super) struct Demoter {
    cap_bytes: u64,
    /// Page bytes handed to the write thread and not yet finished.
    writing_bytes: u64,
    queue: Vec<Demotion>,
    kick: Sender<()>,
    skipped: u64,
    on_disk: u64,
    not_admitted: u64,
}

impl Cache {
    /// Makes eviction hand victims to the disk tier ahead of need, with at most `cap_bytes`
    /// of pages being written at once; `kick` gets a token whenever the queue gains one.
    pub fn enable_demotion(&mut self, cap_bytes: u64, kick: Sender<()>) {
        self.demote = Some(Demoter {
            cap_bytes,
            writing_bytes: 0,
            queue: Vec::new(),
            kick,
            skipped: 0,
            on_disk: 0,
            not_admitted: 0,
        });
    }

    /// Cleans victims of `class` until free, clean and being-written pages make `cap`.
    pub(super) fn clean_ahead(&mut self, class: super::ClassId) {
        loop {
            let Some(d) = self.demote.as_ref() else {
                return;
            };
            // In proportion to the part of the pool that is ready: while a large pool is still
            // being pinned, cleaning ahead for the whole of it would write what is ready.
            let (ready, total) = (self.pool.capacity_bytes(), self.pool.total_bytes().max(1));
            let cap = (u128::from(d.cap_bytes) * u128::from(ready) / u128::from(total)) as u64;
            if self.pool.usage().free_bytes + d.writing_bytes + self.clean_bytes >= cap {
                return;
            }
            let Some(victim) = self.policies[class.0 as usize].peek_victim() else {
                return;
            };
            let on_disk = self.entry(victim).on_disk;
            if on_disk || !self.policies[class.0 as usize].likely_read_again(victim) {
                // The disk has it already (no write needed), or it is not worth the drive's
                // time (admission): next to go as it is, still a hit until its page is needed.
                self.policies[class.0 as usize].remove(victim);
                self.make_clean(victim);
                if on_disk {
                    self.note_evicted(true);
                } else if let Some(d) = self.demote.as_mut() {
                    d.not_admitted += 1;
                }
                continue;
            }
            if !self.demote_one(victim) {
                return;
            }
        }
    }

    /// Puts an unpinned, unheld chunk the disk holds, or one not worth writing, at the young
    /// end of its class's clean pages (out of its policy already).
    fn make_clean(&mut self, id: EntryId) {
        let class = self.entry(id).class;
        self.clean_bytes += self.pool.page_bytes(class);
        self.clean[class.0 as usize].push_front(id);
        self.set_leaving(id, true);
    }

    /// Marks `id` as next to go (handed to the disk tier, or clean) or not, and tells its
    /// parent's policy whether the parent is now as good as a leaf: without that, the policy
    /// would take the next victim from another prefix's tail rather than the chunk before
    /// `id`, and spread L1's losses over every conversation (on the H200 replay, 71.6–75.4%
    /// hits against 83.7% for the same margin taken out of L1 instead).
    fn set_leaving(&mut self, id: EntryId, leaving: bool) {
        if std::mem::replace(&mut self.entry_mut(id).leaving, leaving) == leaving {
            return;
        }
        if let Some(p) = self.tree.parent(id) {
            self.note_leaf(p);
        }
    }

    /// Tells `p`'s policy whether all its children are next to go (or it has none).
    pub(super) fn note_leaf(&mut self, p: EntryId) {
        let entries = &self.entries;
        let leaf = self.tree.all_children(p, |c| {
            entries
                .get(c as usize)
                .and_then(Option::as_ref)
                .is_some_and(|e| e.leaving)
        });
        let class = self.entry(p).class;
        self.policies[class.0 as usize].set_leaf(p, leaf);
    }

    /// A lookup found `id`: its use is recorded, and a chunk the disk tier had cleaned is
    /// wanted again, back among the others.
    pub(super) fn touch(&mut self, id: EntryId) {
        let class = self.entry(id).class;
        if self.policy_kind == super::PolicyKind::Lru {
            self.clock += 1;
            self.entry_mut(id).used = self.clock;
        }
        if self.unclean(id) {
            // Back among the others, and read: a policy that learns from reads learns this one
            // (without it, a clean chunk read again stayed on probation, the next victim).
            self.policies[class.0 as usize].insert(id);
        }
        self.policies[class.0 as usize].touch(id);
    }

    /// Takes `id` out of the clean pages; whether it was there.
    pub(super) fn unclean(&mut self, id: EntryId) -> bool {
        let class = self.entry(id).class;
        if !self.clean[class.0 as usize].unlink(id) {
            return false;
        }
        self.clean_bytes -= self.pool.page_bytes(class);
        self.set_leaving(id, false);
        true
    }

    /// Counts a victim that bypassed the write queue: one the disk holds already (made clean at
    /// once, or evicted), or one lost to the disk because the disk tier fell behind.
    pub(super) fn note_evicted(&mut self, on_disk: bool) {
        if let Some(d) = self.demote.as_mut() {
            if on_disk {
                d.on_disk += 1;
            } else {
                d.skipped += 1;
            }
        }
    }

    /// Hands one victim to the disk tier; false when the pages being written are at the cap.
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
        if d.writing_bytes + bytes > d.cap_bytes {
            return false;
        }
        d.writing_bytes += bytes;
        d.queue.push(Demotion {
            entry: id,
            key,
            offset,
            page_bytes: bytes,
        });
        let _ = d.kick.try_send(());
        // Pinned while written: its page stays as it is, and its slab keeps its class. Still
        // a hit meanwhile.
        self.pin(id);
        self.set_leaving(id, true);
        true
    }

    /// The chunks handed over since the last call, oldest first.
    pub fn take_demotions(&mut self) -> Vec<Demotion> {
        self.demote
            .as_mut()
            .map(|d| std::mem::take(&mut d.queue))
            .unwrap_or_default()
    }

    /// The disk tier is done with these chunks: each is on disk (`true`: it is clean, next to
    /// go) or not (`false`: written from a copy, refused, or failed — it is evicted now, as it
    /// would have been without a disk tier).
    pub fn finish_demotions(&mut self, done: &[(EntryId, bool)]) {
        for &(id, written) in done {
            let class = self.entry(id).class;
            let bytes = self.pool.page_bytes(class);
            if let Some(d) = self.demote.as_mut() {
                d.writing_bytes -= bytes;
            }
            let e = self.entry_mut(id);
            debug_assert_eq!(e.state, State::Ready);
            e.pins -= 1;
            e.on_disk |= written;
            if e.pins > 0 {
                // A lookup or a retrieve has it too: it goes back to its policy with them.
                self.set_leaving(id, false);
                continue;
            }
            self.pinned_pages -= 1;
            if self.rehold(id) {
                self.set_leaving(id, false);
                continue;
            }
            if written {
                self.make_clean(id);
            } else {
                self.remove(id);
                self.counters.evictions += 1;
            }
        }
    }

    /// Victims freed without a disk write because the pages being written were at their cap.
    pub fn demotions_skipped(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.skipped)
    }

    /// Victims that needed no write, the disk holding them already (filled from it, or
    /// written before and read since): made clean at once, or evicted.
    pub fn evicted_on_disk(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.on_disk)
    }

    /// Victims the policy did not expect to be read again, left unwritten (admission): next to
    /// go, as clean chunks are, but lost when their page is taken.
    pub fn demotions_not_admitted(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.not_admitted)
    }

    /// Page bytes handed to the disk tier and not yet written (or given back).
    pub fn demotions_writing_bytes(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.writing_bytes)
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

    #[test]
    fn chunks_are_written_ahead_of_need_and_stay_hits_until_their_page_is_needed() {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(8 * 1024, 1024).unwrap()),
            PolicyKind::Lru,
        );
        let class = c.class_for(1024).unwrap();
        let (tx, rx) = crossbeam_channel::bounded(1);
        c.enable_demotion(2 * 1024, tx);
        // Six stores leave two pages free: nothing needs writing yet.
        for h in 0..6 {
            assert!(stored(&mut c, class, h));
        }
        assert!(c.take_demotions().is_empty());
        // The seventh leaves one free page: the oldest chunk is handed to the disk, and is
        // still a hit while it is written.
        assert!(stored(&mut c, class, 6));
        c.check_invariants();
        let d = c.take_demotions();
        assert_eq!(d.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![0]);
        assert!(rx.try_recv().is_ok(), "the disk tier was woken");
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 1);
        // The last free page: the next oldest is handed over too, the cap is reached.
        assert!(stored(&mut c, class, 7));
        let d2 = c.take_demotions();
        assert_eq!(d2.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![1]);
        // No free page, none clean, the cap reached: a store evicts as without a disk tier.
        assert!(stored(&mut c, class, 8));
        assert_eq!(c.demotions_skipped(), 1);
        assert_eq!(
            c.ready_prefix(1, 0, &[0], &[2]),
            0,
            "chunk 2 was freed unwritten"
        );
        c.check_invariants();
        // Written: both are clean, and still hits.
        c.finish_demotions(&[(d[0].entry, true), (d2[0].entry, true)]);
        c.check_invariants();
        assert_eq!(c.clean_bytes, 2 * 1024);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0, 1]), 2);
        // The next store takes the oldest clean page: nothing is lost, the disk has it.
        assert!(stored(&mut c, class, 9));
        assert_eq!(
            c.evicted_on_disk(),
            0,
            "written, not found on disk when cleaned"
        );
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 0);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[1]), 1);
        c.check_invariants();
        // A lookup of the clean chunk left puts it back among the others.
        let now = tokio::time::Instant::now();
        let ttl = std::time::Duration::from_secs(1);
        assert_eq!(c.lookup(1, &Query::prefix(1, 0, &[0], &[1]), now, ttl).0, 1);
        assert_eq!(c.clean_bytes, 0);
        c.check_invariants();
        // A chunk the disk did not take is evicted when the write thread is done with it.
        let d3 = c.take_demotions();
        assert_eq!(d3.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![3]);
        c.finish_demotions(&[(d3[0].entry, false)]);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[3]), 0);
        c.check_invariants();
    }

    /// Admission: a victim eviction expects no read of (here on probation: stored by key, never
    /// asked for or read) is not written; it stays a hit until its page is needed, then is lost
    /// as it would be without a disk tier. A victim a lookup asked for is written.
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
        // Five chunks stored by key: on probation, the first victims.
        for h in 0..5 {
            assert!(stored(&mut c, class, h));
        }
        // Seven of eight pages used: the margin of two needs one more, and the oldest on
        // probation is not worth writing: next to go unwritten, still a hit.
        assert!(c.take_demotions().is_empty(), "nothing written");
        assert_eq!(c.demotions_not_admitted(), 1);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 1, "still a hit");
        c.check_invariants();
        // A read puts it back among the others: read, it is no longer on probation.
        assert_eq!(c.lookup(1, &Query::prefix(1, 0, &[0], &[0]), now, ttl).0, 1);
        c.check_invariants();
        // The next store makes chunk 1 next to go, unwritten, then the store after takes its page:
        // chunk 1 is gone, and no disk holds it.
        assert!(stored(&mut c, class, 5));
        assert!(stored(&mut c, class, 6));
        assert_eq!(c.ready_prefix(1, 0, &[0], &[1]), 0);
        assert!(c.take_demotions().is_empty());
        assert_eq!(c.demotions_skipped(), 0, "none dropped for lack of room");
        c.check_invariants();
        // Chunks asked for before they are stored push out the rest on probation, unwritten;
        // once only chunks asked for or read are left to evict, those are written.
        let asked: Vec<u128> = (7..13).collect();
        assert_eq!(
            c.lookup(1, &Query::prefix(1, 0, &[0], &asked), now, ttl).0,
            0
        );
        for &h in &asked {
            assert!(stored(&mut c, class, h));
        }
        let written: Vec<u128> = c.take_demotions().iter().map(|d| d.key.hash).collect();
        assert!(
            !written.is_empty(),
            "victims that will be read again are written"
        );
        assert!(
            written.iter().all(|h| !(1..7).contains(h)),
            "only chunks read or asked for are written: {written:?}"
        );
        assert!(
            c.demotions_not_admitted() >= 6,
            "every chunk on probation went unwritten"
        );
        c.check_invariants();
    }

    /// Eight pages of 1 KiB, two of them cleaned ahead for the disk.
    fn demoting(policy: PolicyKind) -> (Cache, crate::l1::pool::ClassId) {
        let mut c = Cache::new(
            PagePool::new(&kvd_gpu::PoolLayout::new(8 * 1024, 1024).unwrap()),
            policy,
        );
        let class = c.class_for(1024).unwrap();
        let (tx, _rx) = crossbeam_channel::bounded(8);
        c.enable_demotion(2 * 1024, tx);
        (c, class)
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

    #[test]
    fn a_fill_takes_only_free_or_clean_pages_and_never_drops_an_unwritten_chunk() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        for h in 0..8 {
            assert!(stored(&mut c, class, h));
        }
        // Full: two chunks being written, none free or clean.
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
        // Once the disk has the two, they are clean, and the fill takes the older's page.
        c.finish_demotions(&out.iter().map(|d| (d.entry, true)).collect::<Vec<_>>());
        assert!(filled(&mut c, class, 100));
        assert_eq!(c.ready_prefix(1, 0, &[0], &[100]), 1);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[0]), 0);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[1]), 1);
        assert_eq!(c.demotions_skipped(), 0);
        c.check_invariants();
    }

    #[test]
    fn chunks_filled_from_the_disk_are_clean_without_a_write() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        // The two oldest chunks came from the disk.
        assert!(filled(&mut c, class, 100));
        assert!(filled(&mut c, class, 101));
        for h in 0..6 {
            assert!(stored(&mut c, class, h));
        }
        // Cleaning ahead took the two filled chunks: clean at once, nothing to write, still
        // hits.
        assert!(c.take_demotions().is_empty());
        assert_eq!(c.clean_bytes, 2 * 1024);
        assert_eq!(c.evicted_on_disk(), 2);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[100, 101]), 2);
        // A store takes the older's page; the next victim was stored, not filled: it goes
        // through the queue.
        assert!(stored(&mut c, class, 6));
        assert_eq!(c.ready_prefix(1, 0, &[0], &[100]), 0);
        let d = c.take_demotions();
        assert_eq!(d.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![0]);
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
    fn a_prefix_is_written_tail_first_and_leaves_in_that_order() {
        let (mut c, class) = demoting(PolicyKind::Prefix);
        // Two conversations of three chunks; A is the older.
        stored_request(&mut c, class, &[10, 11, 12]);
        stored_request(&mut c, class, &[20, 21, 22]);
        // Two more stores: two chunks are handed to the disk, A's tail first, then the chunk
        // before it (as good as a leaf now), not B's tail.
        assert!(stored(&mut c, class, 30));
        assert!(stored(&mut c, class, 31));
        let d = c.take_demotions();
        assert_eq!(
            d.iter().map(|d| d.key.hash).collect::<Vec<_>>(),
            vec![12, 11]
        );
        c.check_invariants();
        c.finish_demotions(&d.iter().map(|d| (d.entry, true)).collect::<Vec<_>>());
        // Both conversations are whole hits until pages are needed; then A's tail goes first.
        assert_eq!(c.ready_prefix(1, 0, &[0], &[10, 11, 12]), 3);
        assert_eq!(c.ready_prefix(1, 0, &[0], &[20, 21, 22]), 3);
        assert!(stored(&mut c, class, 32));
        assert_eq!(c.ready_prefix(1, 0, &[0], &[10, 11, 12]), 2);
        c.check_invariants();
    }

    #[test]
    fn a_chunk_read_while_it_is_written_goes_back_to_its_policy_not_the_clean_pages() {
        let (mut c, class) = demoting(PolicyKind::Lru);
        for h in 0..7 {
            assert!(stored(&mut c, class, h));
        }
        let d = c.take_demotions();
        assert_eq!(d.iter().map(|d| d.key.hash).collect::<Vec<_>>(), vec![0]);
        // A lookup pins it while the disk tier writes it.
        let now = tokio::time::Instant::now();
        let ttl = std::time::Duration::from_secs(1);
        let (hit, pin) = c.lookup(1, &Query::prefix(1, 0, &[0], &[0]).pinned(1), now, ttl);
        assert_eq!((hit, pin != 0), (1, true));
        c.finish_demotions(&[(d[0].entry, true)]);
        assert_eq!(c.clean_bytes, 0, "still pinned by the lookup");
        c.check_invariants();
        // Released after its read: young again, and on disk, so it needs no second write.
        c.release(pin);
        assert_eq!(c.clean_bytes, 0);
        c.check_invariants();
        assert!(c.entry(d[0].entry).on_disk);
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
}
