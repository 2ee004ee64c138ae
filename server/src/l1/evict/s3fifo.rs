//! S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023) over
//! entry ids: a small probationary FIFO, a main FIFO whose read entries get another lap, and a
//! ghost FIFO of the key digests of entries that left the small FIFO unread.

use std::collections::{HashMap, VecDeque};

use super::{EntryId, EvictionPolicy, LinkedList};

/// Highest value of an entry's read counter (two bits, as in the paper).
const MAX_FREQ: u8 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Queue {
    /// Not known to the policy (never created, or forgotten).
    #[default]
    None,
    Small,
    Main,
}

#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    queue: Queue,
    freq: u8,
}

/// Where the next victim comes from; kept current after every call so that `peek_victim` is
/// a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Side {
    #[default]
    Empty,
    Small,
    Main,
}

/// Key digests of entries that left the small FIFO unread, oldest first, at most `cap`
/// distinct ones (a digest remembered again moves to the young end). Stale queue slots are
/// skipped by their sequence number and compacted away when they outnumber live ones.
#[derive(Debug, Default)]
struct Ghost {
    order: VecDeque<(u64, u64)>,
    live: HashMap<u64, u64>,
    seq: u64,
}

impl Ghost {
    fn remember(&mut self, key: u64, cap: usize) {
        self.seq += 1;
        self.live.insert(key, self.seq);
        self.order.push_back((key, self.seq));
        while self.live.len() > cap {
            let Some((k, seq)) = self.order.pop_front() else {
                break;
            };
            if self.live.get(&k) == Some(&seq) {
                self.live.remove(&k);
            }
        }
        if self.order.len() > 2 * self.live.len() + 64 {
            let live = &self.live;
            self.order.retain(|(k, seq)| live.get(k) == Some(seq));
        }
    }

    /// Whether `key` was remembered; forgets it.
    fn take(&mut self, key: u64) -> bool {
        self.live.remove(&key).is_some()
    }
}

/// S3-FIFO over entry ids. The queues hold only evictable entries; an entry's queue and read
/// counter survive its pins (the cache removes a pinned entry and inserts it again), and go
/// when the cache forgets it. An entry coming back from a pin goes to the young end of its
/// queue. The small FIFO's share is a tenth of the evictable entries. The queues are settled
/// after every change (promotions and second laps done at once, not when a victim is needed),
/// so a read just after a promotion counts in main. Victim choice is amortised O(1): each
/// promotion or second lap is paid for by an earlier read.
#[derive(Debug, Default)]
pub(super) struct S3Fifo {
    small: LinkedList,
    main: LinkedList,
    meta: Vec<Meta>,
    ghost: Ghost,
    /// Entries the policy knows (queued or pinned), and the most it has known at once: the
    /// ghost remembers as many keys as the cache has held entries.
    known: usize,
    known_max: usize,
    side: Side,
}

impl S3Fifo {
    fn meta_mut(&mut self, id: EntryId) -> &mut Meta {
        let i = id as usize;
        if self.meta.len() <= i {
            self.meta.resize(i + 1, Meta::default());
        }
        &mut self.meta[i]
    }

    fn know(&mut self, id: EntryId, queue: Queue) {
        let m = self.meta_mut(id);
        let new = m.queue == Queue::None;
        *m = Meta { queue, freq: 0 };
        if new {
            self.known += 1;
            self.known_max = self.known_max.max(self.known);
        }
    }

    /// Promotes read entries at the small FIFO's old end and gives read entries at the main
    /// FIFO's old end another lap, until the old end of the side to evict from is unread.
    fn settle(&mut self) {
        loop {
            let total = self.small.len + self.main.len;
            if self.small.len > 0 && (self.small.len * 10 > total || self.main.len == 0) {
                let t = self.small.tail;
                if self.meta[t as usize].freq == 0 {
                    self.side = Side::Small;
                    return;
                }
                self.small.unlink(t);
                self.meta[t as usize] = Meta {
                    queue: Queue::Main,
                    freq: 0,
                };
                self.main.push_front(t);
            } else if self.main.len > 0 {
                let t = self.main.tail;
                let m = &mut self.meta[t as usize];
                if m.freq == 0 {
                    self.side = Side::Main;
                    return;
                }
                m.freq -= 1;
                self.main.unlink(t);
                self.main.push_front(t);
            } else {
                self.side = Side::Empty;
                return;
            }
        }
    }

    fn list_of(&mut self, queue: Queue) -> &mut LinkedList {
        if queue == Queue::Main {
            &mut self.main
        } else {
            &mut self.small
        }
    }
}

impl EvictionPolicy for S3Fifo {
    fn insert(&mut self, id: EntryId) {
        if self.small.contains(id) || self.main.contains(id) {
            return;
        }
        if self.meta_mut(id).queue == Queue::None {
            self.know(id, Queue::Small);
        }
        let queue = self.meta[id as usize].queue;
        self.list_of(queue).push_front(id);
        self.settle();
    }

    fn touch(&mut self, id: EntryId) {
        if let Some(m) = self.meta.get_mut(id as usize) {
            if m.queue != Queue::None {
                m.freq = (m.freq + 1).min(MAX_FREQ);
                self.settle();
            }
        }
    }

    fn remove(&mut self, id: EntryId) {
        if self.small.unlink(id) || self.main.unlink(id) {
            self.settle();
        }
    }

    fn created(&mut self, id: EntryId, key: u64) {
        let queue = if self.ghost.take(key) {
            Queue::Main
        } else {
            Queue::Small
        };
        self.remove(id);
        self.know(id, queue);
    }

    fn forget(&mut self, id: EntryId, key: u64) {
        self.remove(id);
        let Some(m) = self.meta.get_mut(id as usize) else {
            return;
        };
        let was = std::mem::take(m);
        if was.queue == Queue::None {
            return;
        }
        self.known -= 1;
        if was.queue == Queue::Small && was.freq == 0 {
            self.ghost.remember(key, self.known_max.max(1));
        }
    }

    fn peek_victim(&self) -> Option<EntryId> {
        match self.side {
            Side::Empty => None,
            Side::Small => Some(self.small.tail),
            Side::Main => Some(self.main.tail),
        }
    }

    fn len(&self) -> usize {
        self.small.len + self.main.len
    }
}
