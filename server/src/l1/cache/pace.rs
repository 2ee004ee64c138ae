//! How large a reserve L1 keeps for the disk tier's writes ([`super::demote`]), paced to the
//! drive.
//!
//! The reserve is paid for all the time (L1 holds chunks in the pool less the reserve) and
//! pays off only in a burst of evictions faster than the drive: it holds the victims' pages
//! until the drive has written them, where a smaller one drops them unwritten. Replayed
//! traffic (`replay_events`, benches/results/2026-12-04-session-16.md) showed both sides: with
//! a drive that keeps up between bursts, a reserve of an eighth of the pool served 9–45% more
//! hits than one of 60 pages; with a drive that falls behind for good, the eighth served
//! 3–10% fewer, since the drive writes at its own rate whatever waits for it. No size is right
//! for both, so the reserve follows what the drive does:
//!
//! - A *busy period* runs from a hand-over with nothing being written until every write is
//!   done. One that ends with victims dropped shows a burst the drive did catch up with: the
//!   reserve grows to what would have held all of it (the most held at once plus what was
//!   dropped, less what went to refill a reserve that had just grown), at most `max`.
//! - Within a period that has written the reserve [`SATURATED_ROUNDS`] times over and still
//!   drops more than it writes, the drive is behind for good: each victim dropped shrinks the
//!   reserve by its page, down to `min`. Such a period never grows it.
//! - A period without drops lets the reserve relax toward the most it held: an eighth of the
//!   gap per reserve's worth of bytes written, so a burst that comes back within about eight
//!   reserves' worth of writes finds it still there.
//!
//! No clock: the signals are the writes themselves, so the same traffic paces the same way
//! whatever the drive's speed in bytes per second.

/// Times a busy period writes the whole reserve, still dropping more than it writes, before
/// the drive counts as behind for good.
pub(super) const SATURATED_ROUNDS: u64 = 4;

/// The relaxing rate: one part in this of the gap per reserve's worth written.
const RELAX: u64 = 8;

/// The reserve's size and the busy period that steers it.
#[derive(Debug, Clone)]
pub(super) struct Pace {
    min: u64,
    max: u64,
    bytes: u64,
    period: Period,
}

/// What the current busy period did.
#[derive(Debug, Clone, Copy, Default)]
struct Period {
    /// Most bytes held by the writes at once.
    peak: u64,
    /// Bytes of admitted victims dropped for want of room.
    dropped: u64,
    /// Bytes the writes gave back.
    written: u64,
    /// Bytes of the reserve not yet there when the period began (free pages short of it,
    /// just after it grew): the period's first victims fill it rather than a burst's need.
    short: u64,
    /// Whether it was behind for good at some point: it never grows the reserve then, even if
    /// the drive caught up later on.
    behind: bool,
}

impl Period {
    fn saturated(&self, reserve: u64) -> bool {
        self.written >= SATURATED_ROUNDS * reserve && self.dropped > self.written
    }
}

impl Pace {
    /// A reserve of `bytes` always (`--disk-write-queue-mb` given).
    pub fn fixed(bytes: u64) -> Self {
        Self::paced(bytes, bytes)
    }

    /// A reserve from `min` to `max` bytes, starting at `min`.
    pub fn paced(min: u64, max: u64) -> Self {
        let max = max.max(min);
        Pace {
            min,
            max,
            bytes: min,
            period: Period::default(),
        }
    }

    /// The reserve's size now.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// A victim's page went to the write thread, which now holds `writing` bytes; `free` pool
    /// bytes were free before.
    pub fn handed(&mut self, writing: u64, free: u64) {
        let p = &mut self.period;
        if p.peak == 0 {
            // Nothing was being written: the reserve there was the free pages.
            p.short = self.bytes.saturating_sub(free);
        }
        p.peak = p.peak.max(writing);
    }

    /// An admitted victim of `bytes` was dropped: the writes held the whole reserve.
    pub fn dropped(&mut self, bytes: u64) {
        self.period.dropped += bytes;
        if self.period.saturated(self.bytes) {
            self.period.behind = true;
            self.bytes = self.bytes.saturating_sub(bytes).max(self.min);
        }
    }

    /// The write thread gave back `bytes` (written or not); it still holds `writing`. A
    /// period ends when it holds nothing.
    pub fn written(&mut self, bytes: u64, writing: u64) {
        self.period.written += bytes;
        if writing > 0 {
            return;
        }
        let p = std::mem::take(&mut self.period);
        let need = (p.peak + p.dropped)
            .saturating_sub(p.short)
            .clamp(self.min, self.max);
        if p.dropped > 0 && !p.behind && !p.saturated(self.bytes) {
            self.bytes = self.bytes.max(need);
        } else if need < self.bytes {
            let gap = self.bytes - need;
            let step = u128::from(gap) * u128::from(p.written)
                / (u128::from(RELAX) * u128::from(self.bytes));
            // At least a byte, so that rounding does not stop it short of `need`.
            self.bytes -= gap.min((step as u64).max(u64::from(p.written > 0)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// A burst of `n` pages of 1 MiB arriving faster than the drive, which holds at most the
    /// reserve, the reserve all free at the start; then the drive writes what it holds.
    /// Returns the pages dropped.
    fn burst(p: &mut Pace, n: u64) -> u64 {
        let free = p.bytes();
        burst_from(p, n, free)
    }

    /// As [`burst`], with `free` bytes free at the start.
    fn burst_from(p: &mut Pace, n: u64, mut free: u64) -> u64 {
        let (mut writing, mut dropped) = (0, 0);
        for _ in 0..n {
            if writing + MIB <= p.bytes() {
                p.handed(writing + MIB, free);
                writing += MIB;
                free = free.saturating_sub(MIB);
            } else {
                p.dropped(MIB);
                dropped += 1;
            }
        }
        drain(p, writing);
        dropped
    }

    /// `rounds` of four victims per write, without a pause (the period never ends). Returns
    /// the bytes still being written.
    fn flood(p: &mut Pace, rounds: usize) -> u64 {
        let mut writing = 0;
        for _ in 0..rounds {
            for _ in 0..4 {
                if writing + MIB <= p.bytes() {
                    writing += MIB;
                    p.handed(writing, 0);
                } else {
                    p.dropped(MIB);
                }
            }
            if writing > 0 {
                writing -= MIB;
                p.written(MIB, writing);
            }
        }
        writing
    }

    /// The drive writes what it holds, ending the period.
    fn drain(p: &mut Pace, mut writing: u64) {
        while writing > 0 {
            writing -= MIB;
            p.written(MIB, writing);
        }
    }

    #[test]
    fn a_burst_the_drive_caught_up_with_is_held_whole_the_next_time() {
        let mut p = Pace::paced(4 * MIB, 64 * MIB);
        assert_eq!(
            burst(&mut p, 20),
            16,
            "the first burst finds the least reserve"
        );
        assert_eq!(p.bytes(), 20 * MIB, "grown to what held it all");
        assert_eq!(burst(&mut p, 20), 0);
        // Never past the most allowed.
        assert_eq!(burst(&mut p, 100), 80);
        assert_eq!(p.bytes(), 64 * MIB);
    }

    /// Just after the reserve grew, its pages are chunks of L1 still: the next burst's first
    /// victims go to fill it, and what that costs the burst is no reason to grow again.
    #[test]
    fn refilling_a_reserve_that_just_grew_does_not_grow_it_again() {
        let mut p = Pace::paced(2 * MIB, 64 * MIB);
        assert_eq!(burst(&mut p, 32), 30);
        assert_eq!(p.bytes(), 32 * MIB);
        // Two pages free: the first 30 victims refill the reserve, the burst's own 30 after
        // them are dropped.
        assert_eq!(burst_from(&mut p, 62, 2 * MIB), 30);
        assert_eq!(p.bytes(), 32 * MIB);
        assert_eq!(burst(&mut p, 32), 0);
    }

    #[test]
    fn smaller_periods_let_the_reserve_relax_slowly_toward_what_they_use_never_below_min() {
        let mut p = Pace::paced(4 * MIB, 64 * MIB);
        burst(&mut p, 40);
        assert_eq!(p.bytes(), 40 * MIB);
        // A few small bursts: still there for the big one (a reserve's worth written moves it
        // an eighth of the gap).
        for _ in 0..4 {
            assert_eq!(burst(&mut p, 2), 0);
        }
        assert!(p.bytes() > 39 * MIB, "{}", p.bytes());
        assert_eq!(burst(&mut p, 40), 1, "a page short of it at most");
        assert_eq!(p.bytes(), 40 * MIB, "and grown back");
        // Many: down to the least.
        for _ in 0..10_000 {
            burst(&mut p, 2);
        }
        assert_eq!(p.bytes(), 4 * MIB);
    }

    #[test]
    fn a_drive_behind_for_good_shrinks_the_reserve_to_min_and_never_grows_it() {
        let mut p = Pace::paced(4 * MIB, 64 * MIB);
        burst(&mut p, 32);
        assert_eq!(p.bytes(), 32 * MIB);
        // Victims come four times as fast as the drive writes, without a pause: the period
        // never ends.
        let writing = flood(&mut p, 2_000);
        assert_eq!(p.bytes(), 4 * MIB, "shrunk to the least");
        // When it ends at last, the flood does not count as a burst to hold.
        drain(&mut p, writing);
        assert_eq!(p.bytes(), 4 * MIB);
    }

    /// A period that was behind for good never grows the reserve, even when the drive keeps
    /// pace later in it and ends it having written more than it dropped.
    #[test]
    fn a_period_once_behind_for_good_never_grows_the_reserve() {
        let mut p = Pace::paced(4 * MIB, 64 * MIB);
        let mut writing = flood(&mut p, 200);
        assert_eq!(p.bytes(), 4 * MIB);
        // Then one per write, the drive never idle, until it has written more than it lost.
        for _ in 0..2_000 {
            writing += MIB;
            p.handed(writing, 0);
            writing -= MIB;
            p.written(MIB, writing);
        }
        drain(&mut p, writing);
        assert_eq!(p.bytes(), 4 * MIB, "the flood is no burst to hold");
    }

    #[test]
    fn a_fixed_reserve_stays_as_given() {
        let mut p = Pace::fixed(8 * MIB);
        assert_eq!(burst(&mut p, 100), 92);
        assert_eq!(p.bytes(), 8 * MIB);
        for _ in 0..100 {
            burst(&mut p, 1);
        }
        assert_eq!(p.bytes(), 8 * MIB);
    }
}
