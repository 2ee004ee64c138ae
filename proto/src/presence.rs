//! The presence filter: which chunk keys kvd may hold, in a shared-memory file that clients on
//! kvd's host read without asking kvd.
//!
//! Most lookups in a busy engine find nothing beyond what vLLM's own prefix cache holds (a new
//! prompt's tail), and each still costs a round trip that finds three sleeping threads (kvd's,
//! the client's reader, the engine's): about 0.3 ms, straight onto the request's time to first
//! token. The filter answers "certainly not held" locally; only "maybe held" needs kvd.
//!
//! It is a counting Bloom filter: one byte per slot, [`PROBES`] slots per key, every slot a
//! key maps to counted up when the key enters kvd's index (any state: storing, ready) and down
//! when it leaves. A key whose slots are not all above zero is not in the index. A slot that
//! reaches 255 stays there (it is never counted down again), so it can only err towards "maybe".
//! One writer (kvd, under its cache's lock) and any number of readers; a reader that races a
//! change sees the old or the new count, and either answer is safe: "maybe" costs a round trip,
//! and "not held" for a key stored a moment ago costs a recompute, as a lookup sent a moment
//! earlier would have.
//!
//! Layout (little-endian): [`MAGIC`] (8 bytes), format version (u32), log2 of the slot count
//! (u32), state (u32: [`LIVE`] or [`RETIRED`], which kvd sets as it exits so that no reader
//! trusts a filter nobody keeps), 44 bytes reserved, then the slots. kvd names the file in its
//! hello (`HelloOk::presence`); it offers none when a tier below its memory may hold what the
//! memory lacks (a disk or an L2: their keys are not counted here).

use std::sync::atomic::{AtomicU8, Ordering};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// The file's first bytes.
pub const MAGIC: [u8; 8] = *b"kvdpres1";
/// The format this code reads and writes.
pub const FORMAT: u32 = 1;
/// Bytes before the first slot.
pub const HEADER_BYTES: usize = 64;
/// Slots a key maps to.
pub const PROBES: usize = 3;
/// The state of a filter kvd keeps.
pub const LIVE: u32 = 1;
/// The state of a filter kvd has left.
pub const RETIRED: u32 = 2;
/// Fewest and most slots (log2).
pub const MIN_SLOTS_LOG2: u32 = 16;
/// See [`MIN_SLOTS_LOG2`].
pub const MAX_SLOTS_LOG2: u32 = 28;
/// Offset of the state word.
pub const STATE_OFFSET: usize = 16;

const SEED: u64 = 0x6b76_645f_7072_6573; // "kvd_pres"

/// The slots of the key (fingerprint, salt, shard, hash) among `2^slots_log2`.
pub fn slots(
    fingerprint: u64,
    salt: u64,
    shard: u32,
    hash: u128,
    slots_log2: u32,
) -> [usize; PROBES] {
    let mut b = [0u8; 36];
    b[..8].copy_from_slice(&fingerprint.to_le_bytes());
    b[8..16].copy_from_slice(&salt.to_le_bytes());
    b[16..20].copy_from_slice(&shard.to_le_bytes());
    b[20..].copy_from_slice(&hash.to_le_bytes());
    let h = xxh3_64_with_seed(&b, SEED);
    // Double hashing: probe i is a + i·b, b odd so that the probes differ in any power of two.
    let mask = (1u64 << slots_log2) - 1;
    let (a, step) = (h, (h >> 32) | 1);
    std::array::from_fn(|i| (a.wrapping_add(step.wrapping_mul(i as u64)) & mask) as usize)
}

/// The slot count (log2) for a pool of `pool_bytes`: one slot per 64 KiB, so that a pool full
/// of chunks of at least 1 MiB keeps the slots at most 1/16 used (a false "maybe" under 1%).
pub fn slots_log2_for(pool_bytes: u64) -> u32 {
    let want = (pool_bytes / (64 << 10)).max(1);
    (u64::BITS - (want - 1).leading_zeros()).clamp(MIN_SLOTS_LOG2, MAX_SLOTS_LOG2)
}

/// The header of a new filter of `2^slots_log2` slots, [`LIVE`].
pub fn header(slots_log2: u32) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&FORMAT.to_le_bytes());
    h[12..16].copy_from_slice(&slots_log2.to_le_bytes());
    h[STATE_OFFSET..STATE_OFFSET + 4].copy_from_slice(&LIVE.to_le_bytes());
    h
}

/// Checks a mapped file's first bytes and length; returns the slot count (log2).
pub fn check_header(head: &[u8], file_len: usize) -> Result<u32, String> {
    if head.len() < HEADER_BYTES || head[..8] != MAGIC {
        return Err("not a kvd presence filter (bad magic)".into());
    }
    let format = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    if format != FORMAT {
        return Err(format!(
            "presence filter format {format}, this client reads {FORMAT}: upgrade the kvd package"
        ));
    }
    let log2 = u32::from_le_bytes(head[12..16].try_into().expect("4 bytes"));
    if !(MIN_SLOTS_LOG2..=MAX_SLOTS_LOG2).contains(&log2)
        || file_len != HEADER_BYTES + (1usize << log2)
    {
        return Err(format!(
            "presence filter of 2^{log2} slots in a file of {file_len} bytes"
        ));
    }
    Ok(log2)
}

/// A filter's slots and state, as a reader sees them.
pub trait Slots {
    /// The count in slot `i`.
    fn slot(&self, i: usize) -> u8;
    /// The state word ([`LIVE`], [`RETIRED`]).
    fn state(&self) -> u32;
    /// log2 of the slot count.
    fn slots_log2(&self) -> u32;
}

/// Whether kvd may hold the key: false only when it certainly does not (and the filter is
/// live; a retired one says "maybe" to everything).
pub fn may_hold(f: &impl Slots, fingerprint: u64, salt: u64, shard: u32, hash: u128) -> bool {
    if f.state() != LIVE {
        return true;
    }
    slots(fingerprint, salt, shard, hash, f.slots_log2())
        .iter()
        .all(|&s| f.slot(s) > 0)
}

/// The position of the first of `hashes` kvd certainly does not hold on `shard`, or
/// `hashes.len()` when it may hold them all.
pub fn first_absent(
    f: &impl Slots,
    fingerprint: u64,
    salt: u64,
    shard: u32,
    hashes: &[u128],
) -> usize {
    hashes
        .iter()
        .position(|&h| !may_hold(f, fingerprint, salt, shard, h))
        .unwrap_or(hashes.len())
}

/// The writer's side: counts keys in and out of `slots` (the slot bytes alone, after the
/// header). One writer only.
#[derive(Debug, Clone, Copy)]
pub struct Counter<'a> {
    /// The slots.
    pub slots: &'a [AtomicU8],
    /// log2 of `slots.len()`.
    pub slots_log2: u32,
}

impl Counter<'_> {
    /// Counts a key in.
    pub fn add(&self, fingerprint: u64, salt: u64, shard: u32, hash: u128) {
        for s in slots(fingerprint, salt, shard, hash, self.slots_log2) {
            let c = &self.slots[s];
            let v = c.load(Ordering::Relaxed);
            if v < u8::MAX {
                c.store(v + 1, Ordering::Release);
            }
        }
    }

    /// Counts a key out (only a key counted in).
    pub fn remove(&self, fingerprint: u64, salt: u64, shard: u32, hash: u128) {
        for s in slots(fingerprint, salt, shard, hash, self.slots_log2) {
            let c = &self.slots[s];
            let v = c.load(Ordering::Relaxed);
            // A saturated slot no longer knows its count: it stays.
            if v > 0 && v < u8::MAX {
                c.store(v - 1, Ordering::Release);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    struct Mem {
        state: AtomicU32,
        slots: Vec<AtomicU8>,
        log2: u32,
    }

    impl Mem {
        fn new(log2: u32) -> Self {
            Mem {
                state: AtomicU32::new(LIVE),
                slots: (0..1usize << log2).map(|_| AtomicU8::new(0)).collect(),
                log2,
            }
        }
        fn counter(&self) -> Counter<'_> {
            Counter {
                slots: &self.slots,
                slots_log2: self.log2,
            }
        }
    }

    impl Slots for Mem {
        fn slot(&self, i: usize) -> u8 {
            self.slots[i].load(Ordering::Relaxed)
        }
        fn state(&self) -> u32 {
            self.state.load(Ordering::Relaxed)
        }
        fn slots_log2(&self) -> u32 {
            self.log2
        }
    }

    #[test]
    fn a_key_is_held_from_its_add_until_its_remove() {
        let m = Mem::new(16);
        assert!(!may_hold(&m, 1, 0, 0, 42));
        m.counter().add(1, 0, 0, 42);
        assert!(may_hold(&m, 1, 0, 0, 42));
        // Another fingerprint, salt or shard is another key.
        assert!(
            !may_hold(&m, 2, 0, 0, 42) || !may_hold(&m, 1, 1, 0, 42) || !may_hold(&m, 1, 0, 1, 42)
        );
        m.counter().remove(1, 0, 0, 42);
        assert!(!may_hold(&m, 1, 0, 0, 42));
        assert!(m.slots.iter().all(|s| s.load(Ordering::Relaxed) == 0));
    }

    #[test]
    fn first_absent_finds_the_first_key_not_held() {
        let m = Mem::new(16);
        let hashes: Vec<u128> = (0..10).map(|i| 1000 + i).collect();
        for &h in &hashes[..6] {
            m.counter().add(7, 0, 3, h);
        }
        assert_eq!(first_absent(&m, 7, 0, 3, &hashes), 6);
        assert_eq!(first_absent(&m, 7, 0, 3, &hashes[..6]), 6);
        assert_eq!(first_absent(&m, 7, 0, 4, &hashes), 0);
        m.state.store(RETIRED, Ordering::Relaxed);
        assert_eq!(
            first_absent(&m, 7, 0, 4, &hashes),
            hashes.len(),
            "a retired filter says maybe"
        );
    }

    #[test]
    fn saturated_slots_never_say_absent() {
        let m = Mem::new(16);
        for _ in 0..300 {
            m.counter().add(1, 0, 0, 5);
        }
        for _ in 0..300 {
            m.counter().remove(1, 0, 0, 5);
        }
        assert!(may_hold(&m, 1, 0, 0, 5));
    }

    #[test]
    fn false_maybes_stay_rare_at_the_sized_load() {
        // A 16 GiB pool of 1 MiB chunks: 16k keys in 2^18 slots.
        let log2 = slots_log2_for(16 << 30);
        assert_eq!(log2, 18);
        let m = Mem::new(log2);
        for h in 0..16_384u128 {
            m.counter().add(9, 0, 0, h);
        }
        let false_maybes = ((1u128 << 40)..(1u128 << 40) + 100_000)
            .filter(|&h| may_hold(&m, 9, 0, 0, h))
            .count();
        assert!(
            false_maybes < 1_000,
            "{false_maybes} of 100000 absent keys said maybe"
        );
    }

    #[test]
    fn headers_round_trip_and_bad_ones_are_named() {
        let h = header(17);
        assert_eq!(check_header(&h, HEADER_BYTES + (1 << 17)), Ok(17));
        assert!(check_header(&h, HEADER_BYTES + (1 << 16))
            .unwrap_err()
            .contains("2^17"));
        let mut bad = h;
        bad[8] = 9;
        assert!(check_header(&bad, HEADER_BYTES + (1 << 17))
            .unwrap_err()
            .contains("upgrade"));
        assert!(check_header(&[0u8; 64], 64).unwrap_err().contains("magic"));
        assert_eq!(slots_log2_for(0), MIN_SLOTS_LOG2);
        assert_eq!(slots_log2_for(u64::MAX), MAX_SLOTS_LOG2);
    }
}
