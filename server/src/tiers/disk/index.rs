//! Where chunks lie on the drives: one circular log per drive, and an index from key to place.
//! Pure logic, no I/O, behind one lock held for microseconds.
//!
//! A drive's file is a ring of `capacity` bytes written from a head that only moves forward.
//! Places are *log positions* (bytes ever allocated on that drive); the byte offset is the
//! position modulo the capacity, and a value that would cross the end starts the next lap
//! instead. A value at position `p` is intact exactly while `head <= p + capacity`: after that
//! the head has come round and written over it. So eviction on disk is FIFO and costs nothing —
//! no per-chunk files, no free lists, no fragmentation, large sequential writes — and the
//! index drops what the head passes, oldest first.
//!
//! A place is allocated before its write and becomes a hit only when the write has completed
//! (`commit`); one the head passed in the meantime is never committed. Chunks go to the drives
//! in turn, so one lookup's chunks are read from every drive at once.

use std::collections::{HashMap, VecDeque};

use crate::l1::cache::Key;

/// Where one value lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    /// Drive index.
    pub drive: u16,
    /// Log position on that drive.
    pub pos: u64,
    /// Bytes of the value (header and payload), before rounding up to a block.
    pub value_bytes: u64,
}

/// A place to write a value to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Alloc {
    /// Where it will be.
    pub loc: Loc,
    /// Byte offset in the drive's file.
    pub offset: u64,
    /// Bytes to write (a multiple of the block).
    pub len: u64,
}

#[derive(Debug)]
struct DriveLog {
    capacity: u64,
    head: u64,
    usable: bool,
    /// Committed values in (about) position order, for dropping what the head passes.
    order: VecDeque<(u64, Key)>,
}

/// The index and the drives' logs.
#[derive(Debug)]
pub struct DiskIndex {
    drives: Vec<DriveLog>,
    map: HashMap<Key, Loc>,
    next_drive: usize,
    used_bytes: u64,
    block: u64,
    /// Where the logs start in each drive's file (after kvd's label).
    base: u64,
}

impl DiskIndex {
    /// An empty index over drives of these capacities (multiples of `block`), whose logs start
    /// `base` bytes into each drive.
    pub fn new(capacities: &[u64], block: u64, base: u64) -> DiskIndex {
        DiskIndex {
            drives: capacities
                .iter()
                .map(|&capacity| DriveLog {
                    capacity,
                    head: 0,
                    usable: capacity > 0,
                    order: VecDeque::new(),
                })
                .collect(),
            map: HashMap::new(),
            next_drive: 0,
            used_bytes: 0,
            block,
            base,
        }
    }

    fn aligned(&self, bytes: u64) -> u64 {
        bytes.next_multiple_of(self.block)
    }

    fn intact(&self, loc: &Loc) -> bool {
        let d = &self.drives[loc.drive as usize];
        d.head <= loc.pos + d.capacity
    }

    /// Byte offset of a place in its drive's file.
    pub fn offset(&self, loc: &Loc) -> u64 {
        self.base + loc.pos % self.drives[loc.drive as usize].capacity
    }

    /// Bytes a read of `loc` transfers (whole blocks).
    pub fn read_len(&self, loc: &Loc) -> u64 {
        self.aligned(loc.value_bytes)
    }

    /// Where `key`'s value is, if it is on a usable drive and intact.
    pub fn get(&self, key: &Key) -> Option<Loc> {
        let loc = *self.map.get(key)?;
        (self.drives[loc.drive as usize].usable && self.intact(&loc)).then_some(loc)
    }

    /// A place for a value of `value_bytes` on the next usable drive; `None` when no drive is
    /// usable or the value is larger than a drive. Values the head now passes leave the index.
    pub fn allocate(&mut self, value_bytes: u64) -> Option<Alloc> {
        let len = self.aligned(value_bytes);
        let n = self.drives.len();
        let drive = (0..n)
            .map(|i| (self.next_drive + i) % n)
            .find(|&d| self.drives[d].usable && self.drives[d].capacity >= len)?;
        self.next_drive = (drive + 1) % n;
        let d = &mut self.drives[drive];
        let mut pos = d.head;
        if pos % d.capacity + len > d.capacity {
            pos = pos.next_multiple_of(d.capacity);
        }
        d.head = pos + len;
        self.prune(drive);
        let loc = Loc {
            drive: drive as u16,
            pos,
            value_bytes,
        };
        Some(Alloc {
            loc,
            offset: self.offset(&loc),
            len,
        })
    }

    /// Drops the values drive `drive`'s head has passed.
    fn prune(&mut self, drive: usize) {
        loop {
            let d = &self.drives[drive];
            let Some(&(pos, key)) = d.order.front() else {
                return;
            };
            if d.head <= pos + d.capacity {
                return;
            }
            self.drives[drive].order.pop_front();
            self.forget_at(&key, drive as u16, pos);
        }
    }

    /// Removes `key` if it is still the value at (`drive`, `pos`).
    fn forget_at(&mut self, key: &Key, drive: u16, pos: u64) {
        if let Some(loc) = self.map.get(key) {
            if loc.drive == drive && loc.pos == pos {
                self.used_bytes -= self.aligned(loc.value_bytes);
                self.map.remove(key);
            }
        }
    }

    /// Records that `key`'s value is written at `loc`; false (and nothing recorded) when the
    /// head passed it while it was written.
    pub fn commit(&mut self, key: Key, loc: Loc) -> bool {
        if !self.intact(&loc) {
            return false;
        }
        if let Some(old) = self.map.insert(key, loc) {
            self.used_bytes -= self.aligned(old.value_bytes);
        }
        self.used_bytes += self.aligned(loc.value_bytes);
        self.drives[loc.drive as usize]
            .order
            .push_back((loc.pos, key));
        true
    }

    /// Forgets `key` (its value was found damaged).
    pub fn remove(&mut self, key: &Key) {
        if let Some(loc) = self.map.remove(key) {
            self.used_bytes -= self.aligned(loc.value_bytes);
        }
    }

    /// Takes a drive out of use (I/O errors, full) or back.
    pub fn set_usable(&mut self, drive: usize, usable: bool) {
        self.drives[drive].usable = usable && self.drives[drive].capacity > 0;
    }

    /// Whether a drive is in use.
    pub fn usable(&self, drive: usize) -> bool {
        self.drives[drive].usable
    }

    /// Drives' heads, for the journal.
    pub fn heads(&self) -> Vec<u64> {
        self.drives.iter().map(|d| d.head).collect()
    }

    /// Moves a drive's head forward (replaying the journal).
    pub fn advance_head(&mut self, drive: usize, head: u64) {
        let d = &mut self.drives[drive];
        d.head = d.head.max(head);
    }

    /// Drops every value the heads have passed (after replaying the journal).
    pub fn prune_all(&mut self) {
        for d in 0..self.drives.len() {
            let mut order: Vec<(u64, Key)> = self.drives[d].order.drain(..).collect();
            order.sort_unstable_by_key(|&(pos, _)| pos);
            self.drives[d].order = order.into();
            self.prune(d);
        }
    }

    /// Every indexed value, oldest first per drive, for the journal's snapshot.
    pub fn entries(&self) -> Vec<(Key, Loc)> {
        self.drives
            .iter()
            .enumerate()
            .flat_map(|(d, log)| {
                log.order.iter().filter_map(move |&(pos, key)| {
                    let loc = self.map.get(&key)?;
                    (loc.drive as usize == d && loc.pos == pos).then_some((key, *loc))
                })
            })
            .collect()
    }

    /// Values indexed.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes the indexed values take on the drives.
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    /// Bytes of all drives.
    pub fn capacity_bytes(&self) -> u64 {
        self.drives.iter().map(|d| d.capacity).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(hash: u128) -> Key {
        Key {
            fingerprint: 1,
            salt: 0,
            shard: 0,
            hash,
        }
    }

    fn put(ix: &mut DiskIndex, hash: u128, bytes: u64) -> Alloc {
        let a = ix.allocate(bytes).unwrap();
        assert!(ix.commit(key(hash), a.loc));
        a
    }

    #[test]
    fn chunks_go_to_the_drives_in_turn_and_the_head_evicts_the_oldest() {
        let mut ix = DiskIndex::new(&[16384, 16384], 4096, 0);
        let a = put(&mut ix, 0, 5000); // two blocks on drive 0
        let b = put(&mut ix, 1, 5000); // drive 1
        assert_eq!((a.loc.drive, b.loc.drive), (0, 1));
        assert_eq!((a.offset, a.len), (0, 8192));
        put(&mut ix, 2, 5000); // drive 0, blocks 2-3: the drive is full
        assert_eq!(ix.len(), 3);
        assert_eq!(ix.used_bytes(), 3 * 8192);
        let d = put(&mut ix, 3, 100); // drive 1
        assert_eq!(d.offset, 8192);
        // Drive 0 comes round: chunk 0 is overwritten, chunk 2 is not.
        let e = put(&mut ix, 4, 100);
        assert_eq!((e.loc.drive, e.offset), (0, 0));
        assert_eq!(ix.get(&key(0)), None);
        assert!(ix.get(&key(2)).is_some());
    }

    #[test]
    fn a_value_that_would_cross_the_end_starts_the_next_lap() {
        let mut ix = DiskIndex::new(&[12288], 4096, 0);
        put(&mut ix, 0, 8000);
        let b = put(&mut ix, 1, 8000);
        assert_eq!(b.offset, 0, "8 KiB do not fit in the last 4 KiB");
        assert_eq!(ix.get(&key(0)), None);
        assert!(ix.allocate(20000).is_none(), "larger than the drive");
    }

    #[test]
    fn a_place_the_head_passed_during_its_write_is_not_committed() {
        let mut ix = DiskIndex::new(&[8192], 4096, 0);
        let slow = ix.allocate(4096).unwrap();
        put(&mut ix, 1, 4096);
        put(&mut ix, 2, 4096); // over `slow`'s block
        assert!(!ix.commit(key(0), slow.loc));
        assert_eq!(ix.get(&key(0)), None);
    }

    #[test]
    fn an_unusable_drive_is_skipped_and_its_chunks_are_misses() {
        let mut ix = DiskIndex::new(&[8192, 8192], 4096, 0);
        put(&mut ix, 0, 100);
        ix.set_usable(0, false);
        assert_eq!(ix.get(&key(0)), None);
        assert_eq!(put(&mut ix, 1, 100).loc.drive, 1);
        assert_eq!(put(&mut ix, 2, 100).loc.drive, 1);
        ix.set_usable(1, false);
        assert!(ix.allocate(100).is_none());
    }

    proptest! {
        #[test]
        fn indexed_values_never_overlap_and_bytes_add_up(
            sizes in proptest::collection::vec(1u64..20_000, 1..200),
        ) {
            let mut ix = DiskIndex::new(&[65536, 40960], 4096, 0);
            for (i, &s) in sizes.iter().enumerate() {
                put(&mut ix, i as u128, s);
                let live = ix.entries();
                prop_assert_eq!(live.len(), ix.len());
                let used: u64 = live.iter().map(|(_, l)| ix.read_len(l)).sum();
                prop_assert_eq!(used, ix.used_bytes());
                for (j, (_, a)) in live.iter().enumerate() {
                    let (oa, la) = (ix.offset(a), ix.read_len(a));
                    prop_assert!(oa + la <= ix.drives[a.drive as usize].capacity);
                    for (_, b) in &live[j + 1..] {
                        if a.drive == b.drive {
                            let (ob, lb) = (ix.offset(b), ix.read_len(b));
                            prop_assert!(oa + la <= ob || ob + lb <= oa, "overlap");
                        }
                    }
                }
            }
        }
    }
}
