//! The removal feed: which chunks left the pool, for clients that mirror kvd's contents (vLLM's
//! `BlockRemoved` KV events, KV-aware routers). Pure logic, owned by the [`crate::l1::cache::Cache`]
//! and read under its lock.
//!
//! Every removal from the index — an eviction, or a store or L2 fill whose copy failed — is one
//! record with a sequence number, 1 for the first and one more for each after. The feed keeps
//! the newest `capacity` records in a ring and forgets older ones: it is bounded and lossy, never
//! a backlog that grows while no client reads it, and never backpressure on eviction. A reader
//! keeps the sequence number it has read up to; a read after it returns what the ring still
//! holds and counts what it no longer does (`dropped`), so a client always knows it missed
//! removals and can fall back (vLLM: treat its view of kvd as stale). Clients read at their own
//! pace and kvd keeps no per-client state.
//!
//! Only L1 is reported: with an L2 tier, a chunk removed from the pool may still be served from
//! L2 after a lookup fetches it back.

use std::collections::VecDeque;

use clap::Args;

use super::key::Key;
use crate::config::ConfigError;

/// Records the feed keeps by default: 48 bytes each, 3 MiB. Evictions run at the store rate: at
/// 50 GB/s of stores that is about 40 s of them with Llama-8B's 32 MiB chunks (256 tokens) and
/// 1.3 s with 1 MiB chunks, against a reader that polls every scheduler step (milliseconds).
pub const DEFAULT_CAPACITY: usize = 1 << 16;
/// Most records the feed may keep (about 200 MiB).
pub const MAX_CAPACITY: usize = 1 << 22;

/// The feed's flags.
#[derive(Debug, Clone, Args)]
pub struct FeedArgs {
    /// Removal records (evicted chunks) kept for clients' `Events` requests; a client that falls
    /// further behind is told how many it missed (`kvd_events_dropped_total`).
    #[arg(
        long,
        default_value_t = DEFAULT_CAPACITY,
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub events_capacity: usize,
}

impl FeedArgs {
    /// The ring's capacity, checked.
    pub fn resolve(&self) -> Result<usize, ConfigError> {
        if self.events_capacity == 0 || self.events_capacity > MAX_CAPACITY {
            return Err(ConfigError(format!(
                "--events-capacity {}: use 1 to {MAX_CAPACITY} records, e.g. {DEFAULT_CAPACITY}",
                self.events_capacity
            )));
        }
        Ok(self.events_capacity)
    }
}

/// What one read of the feed returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedPage {
    /// Records after `since` and after the dropped ones, oldest first.
    pub records: Vec<Key>,
    /// The sequence number of the last record returned, or where the next read should start.
    pub next: u64,
    /// Records after `since` the ring had already overwritten.
    pub dropped: u64,
}

/// A bounded ring of removal records with sequence numbers.
#[derive(Debug)]
pub struct RemovalFeed {
    ring: VecDeque<Key>,
    capacity: usize,
    /// Sequence number of the newest record (0 before the first).
    head: u64,
}

impl RemovalFeed {
    /// An empty feed keeping at most `capacity` records (at least one).
    pub fn new(capacity: usize) -> Self {
        RemovalFeed {
            ring: VecDeque::new(),
            capacity: capacity.max(1),
            head: 0,
        }
    }

    /// Appends a removal, forgetting the oldest record when the ring is full.
    pub fn push(&mut self, key: Key) {
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back(key);
        self.head += 1;
    }

    /// Sequence number of the newest record (0 before the first).
    pub fn head(&self) -> u64 {
        self.head
    }

    /// At most `max` records after sequence number `since`; see the module header. A `since`
    /// beyond the newest record returns nothing and `next = head`, so a reader can start from now.
    pub fn read(&self, since: u64, max: usize) -> FeedPage {
        if since >= self.head {
            return FeedPage {
                records: Vec::new(),
                next: self.head,
                dropped: 0,
            };
        }
        // The ring holds sequence numbers oldest..=head.
        let oldest = self.head - self.ring.len() as u64 + 1;
        let start = (since + 1).max(oldest);
        let dropped = start - (since + 1);
        let n = ((self.head - start + 1) as usize).min(max);
        let skip = (start - oldest) as usize;
        FeedPage {
            records: self.ring.iter().skip(skip).take(n).copied().collect(),
            next: start + n as u64 - 1,
            dropped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(i: u64) -> Key {
        Key {
            fingerprint: 7,
            salt: 0,
            shard: (i % 3) as u32,
            hash: u128::from(i),
        }
    }

    fn feed(capacity: usize, pushes: u64) -> RemovalFeed {
        let mut f = RemovalFeed::new(capacity);
        for i in 1..=pushes {
            f.push(key(i));
        }
        f
    }

    #[test]
    fn a_reader_sees_every_record_in_order_when_it_keeps_up() {
        let f = feed(8, 5);
        let p = f.read(0, 3);
        assert_eq!(p.records, vec![key(1), key(2), key(3)]);
        assert_eq!((p.next, p.dropped), (3, 0));
        let p = f.read(p.next, 100);
        assert_eq!(p.records, vec![key(4), key(5)]);
        assert_eq!((p.next, p.dropped), (5, 0));
        let p = f.read(p.next, 100);
        assert!(p.records.is_empty());
        assert_eq!((p.next, p.dropped), (5, 0));
    }

    #[test]
    fn an_overwritten_record_is_counted_and_skipped() {
        let f = feed(4, 10);
        // The ring holds 7..=10; 1..=6 are gone.
        let p = f.read(2, 2);
        assert_eq!(p.dropped, 4, "3, 4, 5 and 6 were overwritten");
        assert_eq!(p.records, vec![key(7), key(8)]);
        assert_eq!(p.next, 8);
        let p = f.read(0, 0);
        assert_eq!((p.records.len(), p.next, p.dropped), (0, 6, 6));
    }

    #[test]
    fn a_position_past_the_newest_restarts_from_now() {
        let f = feed(4, 3);
        for since in [3, 4, u64::MAX] {
            let p = f.read(since, 10);
            assert_eq!(
                (p.records.len(), p.next, p.dropped),
                (0, 3, 0),
                "since {since}"
            );
        }
        assert_eq!(feed(4, 0).read(0, 10).next, 0);
    }

    #[test]
    fn capacity_must_be_in_range() {
        for bad in [0, MAX_CAPACITY + 1] {
            let e = FeedArgs {
                events_capacity: bad,
            }
            .resolve()
            .unwrap_err();
            assert!(e.0.contains("--events-capacity"), "{e}");
        }
    }

    proptest! {
        /// Against a model that keeps every record: a read returns the model's records after
        /// `since`, minus exactly the `dropped` oldest, and `next` accounts for both.
        #[test]
        fn reads_match_a_model_that_forgets_nothing(
            capacity in 1usize..16,
            pushes in 0u64..60,
            since in 0u64..70,
            max in 0usize..20,
        ) {
            let f = feed(capacity, pushes);
            let p = f.read(since, max);
            let after: Vec<Key> = (since + 1..=pushes).map(key).collect();
            if since >= pushes {
                prop_assert_eq!(p, FeedPage { records: vec![], next: pushes, dropped: 0 });
            } else {
                let kept = after.len().min(capacity);
                prop_assert_eq!(p.dropped as usize, after.len() - kept);
                prop_assert_eq!(p.records.len(), kept.min(max));
                prop_assert_eq!(&p.records[..], &after[p.dropped as usize..][..p.records.len()]);
                prop_assert_eq!(p.next, since + p.dropped + p.records.len() as u64);
            }
        }
    }
}
