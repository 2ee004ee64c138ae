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
//! `cap` is `--disk-write-queue-mb` (at most an eighth of the pool). When the disk falls that
//! far behind, allocations evict as they do without a disk tier; those chunks are lost to the
//! disk too, and counted ([`Cache::demotions_skipped`]).

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
        });
    }

    /// Demotes victims of `class` until free pages and pages on their way out make `cap`.
    pub(super) fn clean_ahead(&mut self, class: super::ClassId) {
        loop {
            let Some(d) = self.demote.as_ref() else {
                return;
            };
            if self.pool.usage().free_bytes + d.held_bytes >= d.cap_bytes {
                return;
            }
            let Some(victim) = self.policies[class.0 as usize].peek_victim() else {
                return;
            };
            if !self.demote_one(victim) {
                return;
            }
            self.counters.evictions += 1;
        }
    }

    /// Counts a victim freed without reaching the disk (the disk tier fell behind).
    pub(super) fn note_unwritten(&mut self) {
        if let Some(d) = self.demote.as_mut() {
            d.skipped += 1;
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
        // Out of the policy and pinned: never a victim again, its slab stays.
        self.pin(id);
        self.entry_mut(id).state = State::Demoting;
        self.map.remove(&key);
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
            self.remove(id);
        }
    }

    /// Victims freed without a disk write because the held pages were at their cap.
    pub fn demotions_skipped(&self) -> u64 {
        self.demote.as_ref().map_or(0, |d| d.skipped)
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
}
