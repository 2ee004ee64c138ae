//! Policy unit tests and model-based property tests.

use super::*;
use proptest::prelude::*;
use std::collections::HashMap;

/// Takes the next victim out, as the cache does when it evicts it.
fn pop_victim(p: &mut Box<dyn EvictionPolicy>) -> Option<EntryId> {
    let v = p.peek_victim()?;
    p.remove(v);
    Some(v)
}

#[test]
fn lru_evicts_the_least_recently_used() {
    let mut p = PolicyKind::Lru.build();
    for id in [1, 2, 3] {
        p.insert(id);
    }
    p.touch(1);
    assert_eq!(pop_victim(&mut p), Some(2));
    p.remove(3);
    assert_eq!(pop_victim(&mut p), Some(1));
    assert_eq!(pop_victim(&mut p), None);
}

#[test]
fn fifo_ignores_reads() {
    let mut p = PolicyKind::Fifo.build();
    for id in [5, 6] {
        p.insert(id);
    }
    p.touch(5);
    assert_eq!(pop_victim(&mut p), Some(5));
}

#[test]
fn names_parse() {
    assert_eq!("LRU".parse(), Ok(PolicyKind::Lru));
    assert_eq!("fifo".parse(), Ok(PolicyKind::Fifo));
    assert_eq!("S3FIFO".parse(), Ok(PolicyKind::S3Fifo));
    assert!("arc".parse::<PolicyKind>().is_err());
    for name in PolicyKind::NAMES {
        assert!(name.parse::<PolicyKind>().is_ok(), "{name}");
    }
}

/// A cache of `capacity` entries keyed by `u64` over a policy, as `Cache` drives it: a
/// miss stores (evicting first when full), a hit touches, pins and unpins (the lookup, then
/// the retrieve). Returns the hits.
fn replay(kind: PolicyKind, capacity: usize, keys: &[u64]) -> usize {
    let mut p = kind.build();
    let mut ids: HashMap<u64, EntryId> = HashMap::new();
    let mut keys_of: HashMap<EntryId, u64> = HashMap::new();
    let mut free: Vec<EntryId> = (0..capacity as EntryId).rev().collect();
    let mut hits = 0;
    for &k in keys {
        if let Some(&id) = ids.get(&k) {
            hits += 1;
            p.touch(id);
            p.remove(id);
            p.insert(id);
            continue;
        }
        if free.is_empty() {
            let v = p.peek_victim().expect("a full cache has a victim");
            p.forget(v, keys_of[&v]);
            ids.remove(&keys_of[&v]);
            free.push(v);
        }
        let id = free.pop().unwrap();
        p.created(id, k);
        ids.insert(k, id);
        keys_of.insert(id, k);
        p.insert(id);
    }
    hits
}

#[test]
fn s3fifo_sends_unread_entries_out_before_read_ones() {
    let mut p = PolicyKind::S3Fifo.build();
    for id in 0..10 {
        p.created(id, 100 + id as u64);
        p.insert(id);
    }
    p.touch(0);
    for id in 10..20 {
        p.created(id, 100 + id as u64);
        p.insert(id);
    }
    let order: Vec<EntryId> = std::iter::from_fn(|| pop_victim(&mut p)).collect();
    assert_eq!(order.len(), 20);
    assert_eq!(
        *order.last().unwrap(),
        0,
        "the one read entry goes last: {order:?}"
    );
    assert_eq!(
        &order[..9],
        &[1, 2, 3, 4, 5, 6, 7, 8, 9],
        "the unread go in FIFO order"
    );
}

#[test]
fn s3fifo_sends_a_key_evicted_unread_and_stored_again_to_main() {
    let mut p = PolicyKind::S3Fifo.build();
    for id in 0..10 {
        p.created(id, id as u64);
        p.insert(id);
    }
    assert_eq!(p.peek_victim(), Some(0));
    p.forget(0, 0);
    // Key 0 is stored again (id 0 reused); key 50 is new.
    p.created(0, 0);
    p.insert(0);
    p.created(10, 50);
    p.insert(10);
    let order: Vec<EntryId> = std::iter::from_fn(|| pop_victim(&mut p)).collect();
    assert_eq!(
        *order.last().unwrap(),
        0,
        "the remembered key went to main: {order:?}"
    );
}

#[test]
fn s3fifo_keeps_a_read_count_across_pins() {
    let mut p = PolicyKind::S3Fifo.build();
    for id in 0..5 {
        p.created(id, id as u64);
        p.insert(id);
    }
    // A lookup hit: read, pinned (out of the policy), unpinned after the retrieve.
    p.touch(0);
    p.remove(0);
    assert_eq!(p.len(), 4);
    p.insert(0);
    let order: Vec<EntryId> = std::iter::from_fn(|| pop_victim(&mut p)).collect();
    assert_eq!(order, vec![1, 2, 3, 4, 0]);
}

#[test]
fn s3fifo_keeps_a_reread_working_set_through_a_scan_that_lru_does_not() {
    // 40 keys read twice each pass, then a one-off scan of 100 keys, in a cache of 60: every
    // scan flushes LRU (only the second reads hit); S3-FIFO promoted the working set to its
    // main FIFO on the second read, and the scan passes through the small one.
    let mut keys = Vec::new();
    for pass in 0..20u64 {
        keys.extend(0..40);
        keys.extend(0..40);
        keys.extend((0..100).map(|i| 1000 + pass * 1000 + i));
    }
    let lru = replay(PolicyKind::Lru, 60, &keys);
    let s3 = replay(PolicyKind::S3Fifo, 60, &keys);
    assert_eq!(lru, 20 * 40, "LRU hits only the second reads");
    assert!(
        s3 >= 40 + 19 * 80 * 9 / 10,
        "S3-FIFO kept the working set: {s3} hits"
    );
}

#[test]
fn prefix_evicts_leaves_before_inner_entries() {
    let mut p = PolicyKind::Prefix.build();
    for id in 0..4 {
        p.created(id, id as u64);
        p.set_leaf(id, id == 3);
        p.insert(id);
    }
    // 0 ← 1 ← 2 ← 3: only 3 is a leaf, though it is the newest.
    assert_eq!(pop_victim(&mut p), Some(3));
    p.set_leaf(2, true);
    assert_eq!(pop_victim(&mut p), Some(2));
    // No leaf left evictable: the oldest inner entry goes.
    assert_eq!(pop_victim(&mut p), Some(0));
    assert_eq!(p.len(), 1);
}

#[test]
fn prefix_reuse_keeps_the_leaf_read_at_a_short_distance() {
    let mut p = PolicyKind::PrefixReuse.build();
    for id in 0..2 {
        p.created(id, id as u64);
        p.insert(id);
    }
    // 0 is read at a short distance, 1 at a long one: 1's next read is further away.
    p.touch(0);
    p.touch(1);
    for _ in 0..3 {
        p.touch(0);
    }
    p.touch(1);
    p.touch(0);
    assert_eq!(pop_victim(&mut p), Some(1));
    // An overdue leaf goes first, whatever its distance.
    let mut p = PolicyKind::PrefixReuse.build();
    for id in 0..3 {
        p.created(id, id as u64);
        p.insert(id);
    }
    p.touch(0);
    for _ in 0..10 {
        p.touch(1);
        p.touch(2);
    }
    assert_eq!(pop_victim(&mut p), Some(0), "0 idled far past its distance");
}

proptest! {
    /// The prefix policy against a model: the victim is the least recently used evictable
    /// leaf, else the least recently used evictable entry.
    #[test]
    fn prefix_matches_a_model(ops in proptest::collection::vec((0u8..6, 0u32..12), 0..300)) {
        let mut p = PolicyKind::Prefix.build();
        // id -> (stamp, leaf, queued)
        let mut m: HashMap<u32, (u64, bool, bool)> = HashMap::new();
        let mut clock = 0u64;
        for (op, id) in ops {
            match op {
                0 => { p.created(id, 0); m.insert(id, (0, true, false)); }
                1 => {
                    p.insert(id);
                    let e = m.entry(id).or_insert((0, true, false));
                    if !e.2 { clock += 1; *e = (clock, e.1, true); }
                }
                2 => {
                    p.touch(id);
                    if let Some(e) = m.get_mut(&id) { if e.2 { clock += 1; e.0 = clock; } }
                }
                3 => { p.remove(id); if let Some(e) = m.get_mut(&id) { e.2 = false; } }
                4 => {
                    let leaf = id % 2 == 0;
                    p.set_leaf(id, leaf);
                    m.entry(id).or_insert((0, true, false)).1 = leaf;
                }
                _ => {
                    let want = m.iter().filter(|(_, e)| e.2 && e.1).min_by_key(|(_, e)| e.0)
                        .or_else(|| m.iter().filter(|(_, e)| e.2).min_by_key(|(_, e)| e.0))
                        .map(|(&id, _)| id);
                    prop_assert_eq!(pop_victim(&mut p), want);
                    if let Some(v) = want { m.get_mut(&v).unwrap().2 = false; }
                }
            }
            prop_assert_eq!(p.len(), m.values().filter(|e| e.2).count());
        }
    }
}

proptest! {
    /// Against a model: the victim is always the oldest (FIFO) or least recently touched
    /// (LRU) entry among those inserted and not removed.
    #[test]
    fn matches_a_model(lru in any::<bool>(), ops in proptest::collection::vec((0u8..4, 0u32..16), 0..200)) {
        let kind = if lru { PolicyKind::Lru } else { PolicyKind::Fifo };
        let mut p = kind.build();
        let mut model: Vec<u32> = Vec::new(); // front = newest
        for (op, id) in ops {
            match op {
                0 => if !model.contains(&id) { model.insert(0, id); p.insert(id); },
                1 => {
                    p.touch(id);
                    if lru {
                        if let Some(pos) = model.iter().position(|&x| x == id) {
                            model.remove(pos);
                            model.insert(0, id);
                        }
                    }
                }
                2 => { p.remove(id); model.retain(|&x| x != id); }
                _ => { prop_assert_eq!(pop_victim(&mut p), model.pop()); }
            }
            prop_assert_eq!(p.len(), model.len());
        }
    }

    /// Against a plain model of S3-FIFO (vectors, scanned each step): the same victims for
    /// any sequence of stores, reads, pins, unpins and evictions, with keys recurring so
    /// that the ghost is exercised.
    #[test]
    fn s3fifo_matches_a_model(ops in proptest::collection::vec((0u8..6, 0u32..16, 0u64..24), 0..300)) {
        let mut p = PolicyKind::S3Fifo.build();
        let mut m = Model::default();
        for (op, id, key) in ops {
            match op {
                // A store: a fresh entry for a key, pinned while written, then inserted.
                0 => if !m.known.contains_key(&id) {
                    p.created(id, key);
                    m.created(id, key);
                    p.insert(id);
                    m.insert(id);
                },
                1 => { p.touch(id); m.touch(id); }
                2 => { p.remove(id); m.remove(id); }
                3 => if m.known.contains_key(&id) { p.insert(id); m.insert(id); },
                4 => if let Some(&key) = m.key.get(&id) { p.forget(id, key); m.forget(id, key); },
                _ => if let Some(v) = m.victim() {
                    let key = m.key[&v];
                    p.forget(v, key);
                    m.forget(v, key);
                },
            }
            prop_assert_eq!(p.peek_victim(), m.victim());
            prop_assert_eq!(p.len(), m.small.len() + m.main.len());
        }
    }
}

/// S3-FIFO written plainly: queues are vectors, newest first; `victim` settles the queues
/// as the policy does after every change.
#[derive(Default)]
struct Model {
    small: Vec<u32>,
    main: Vec<u32>,
    /// Queue (true: main) and read count of every known entry.
    known: HashMap<u32, (bool, u8)>,
    key: HashMap<u32, u64>,
    ghost: Vec<u64>,
    known_max: usize,
}

impl Model {
    fn created(&mut self, id: u32, key: u64) {
        let main = if let Some(i) = self.ghost.iter().position(|&k| k == key) {
            self.ghost.remove(i);
            true
        } else {
            false
        };
        self.known.insert(id, (main, 0));
        self.key.insert(id, key);
        self.known_max = self.known_max.max(self.known.len());
    }
    fn insert(&mut self, id: u32) {
        if self.small.contains(&id) || self.main.contains(&id) {
            return;
        }
        let main = self.known.entry(id).or_insert((false, 0)).0;
        self.known_max = self.known_max.max(self.known.len());
        if main {
            self.main.insert(0, id)
        } else {
            self.small.insert(0, id)
        }
    }
    fn touch(&mut self, id: u32) {
        if let Some(e) = self.known.get_mut(&id) {
            e.1 = (e.1 + 1).min(3);
        }
    }
    fn remove(&mut self, id: u32) {
        self.small.retain(|&x| x != id);
        self.main.retain(|&x| x != id);
    }
    fn forget(&mut self, id: u32, key: u64) {
        self.remove(id);
        self.key.remove(&id);
        if let Some((main, freq)) = self.known.remove(&id) {
            if !main && freq == 0 {
                self.ghost.retain(|&k| k != key);
                self.ghost.push(key);
                while self.ghost.len() > self.known_max.max(1) {
                    self.ghost.remove(0);
                }
            }
        }
    }
    fn victim(&mut self) -> Option<u32> {
        loop {
            let total = self.small.len() + self.main.len();
            if !self.small.is_empty() && (self.small.len() * 10 > total || self.main.is_empty()) {
                let t = *self.small.last().unwrap();
                if self.known[&t].1 == 0 {
                    return Some(t);
                }
                self.small.pop();
                self.known.insert(t, (true, 0));
                self.main.insert(0, t);
            } else if let Some(&t) = self.main.last() {
                let e = self.known.get_mut(&t).unwrap();
                if e.1 == 0 {
                    return Some(t);
                }
                e.1 -= 1;
                self.main.pop();
                self.main.insert(0, t);
            } else {
                return None;
            }
        }
    }
}

#[test]
fn prefix_reuse_keeps_the_newest_of_a_burst_of_stores_before_any_read() {
    // A burst of stores that no lookup asked for, before any read (the data-plane benchmark's
    // 8 requests in flight, which store and retrieve by key) must keep what it stored last:
    // those are read next. (Taking the newest first there, as a cold-pool rule briefly did for
    // every chunk, made every retrieve of the burst miss on the H200.)
    let mut p = PolicyKind::PrefixReuse.build();
    for id in 0..4 {
        p.created(id, id as u64);
        p.insert(id);
    }
    assert_eq!(pop_victim(&mut p), Some(0));
    assert_eq!(pop_victim(&mut p), Some(1));
}

#[test]
fn prefix_reuse_keeps_what_it_holds_of_chunks_asked_for_and_not_read() {
    // Chunks a lookup asked for before they were stored, none read: the newest goes first, so a
    // loop of conversations larger than the pool keeps the ones it holds.
    let mut p = PolicyKind::PrefixReuse.build();
    for id in 0..4 {
        p.created(id, id as u64);
        p.asked(id);
        p.insert(id);
    }
    assert_eq!(pop_victim(&mut p), Some(3));
    assert_eq!(pop_victim(&mut p), Some(2));
    // A read gives 0 a distance. A chunk continuing 0's prefix inherits it; one starting a new
    // prefix has none still, and goes first, then the older unread 1.
    p.touch(0);
    p.created(4, 4);
    p.inherit(4, 0);
    p.asked(4);
    p.insert(4);
    p.created(5, 5);
    p.asked(5);
    p.insert(5);
    assert_eq!(pop_victim(&mut p), Some(5));
    assert_eq!(pop_victim(&mut p), Some(1));
    assert_eq!(p.len(), 2);
}

#[test]
fn prefix_reuse_lets_go_of_an_unknown_chunk_idle_past_every_distance_seen() {
    // Unread chunks asked for are kept, the newest going first, but not for good: one idle for
    // 1.5 times the longest reuse distance seen is overdue and goes first, oldest first, so
    // chunks never read again do not hold their pages against newer ones.
    let asked = |p: &mut Box<dyn EvictionPolicy>, id: EntryId| {
        p.created(id, u64::from(id));
        p.asked(id);
        p.insert(id);
    };
    // Longest distance 1 (chunk 2 read right after its store): 0, idle 3, is overdue.
    let mut p = PolicyKind::PrefixReuse.build();
    asked(&mut p, 0); // clock 1
    asked(&mut p, 1); // clock 2
    p.created(2, 2);
    p.insert(2); // clock 3
    p.touch(2); // clock 4: distance 1
    assert_eq!(pop_victim(&mut p), Some(0));
    // Longest distance 3: 0, idle 2, is not; the newest unknown goes.
    let mut p = PolicyKind::PrefixReuse.build();
    p.created(2, 2);
    p.insert(2); // clock 1
    asked(&mut p, 0); // clock 2
    asked(&mut p, 1); // clock 3
    p.touch(2); // clock 4: distance 3
    assert_eq!(pop_victim(&mut p), Some(1));
}

proptest! {
    /// prefix-reuse never names a victim it was not given or that was taken back (pinned),
    /// takes a leaf whenever an evictable leaf exists, and keeps count, for any sequence of
    /// stores (asked for by a lookup or not), reads, pins, leaf changes and evictions (the ones
    /// with no read at all included, where distances are unknown).
    #[test]
    fn prefix_reuse_picks_only_evictable_entries(ops in proptest::collection::vec((0u8..8, 0u32..12, 0u32..12), 0..300)) {
        let mut p = PolicyKind::PrefixReuse.build();
        // id -> (leaf, queued)
        let mut m: HashMap<u32, (bool, bool)> = HashMap::new();
        for (op, id, other) in ops {
            match op {
                0 => { p.created(id, u64::from(id)); m.insert(id, (true, false)); }
                1 => { p.insert(id); m.entry(id).or_insert((true, false)).1 = true; }
                2 => p.touch(id),
                3 => { p.remove(id); if let Some(e) = m.get_mut(&id) { e.1 = false; } }
                4 => {
                    let leaf = other % 2 == 0;
                    p.set_leaf(id, leaf);
                    m.entry(id).or_insert((true, false)).0 = leaf;
                }
                5 => p.inherit(id, other),
                6 => p.asked(id),
                _ => {
                    let leaf_evictable = m.values().any(|e| e.0 && e.1);
                    match pop_victim(&mut p) {
                        Some(v) => {
                            let e = m.get_mut(&v);
                            prop_assert!(e.as_ref().is_some_and(|e| e.1), "victim {} was not evictable", v);
                            let e = e.unwrap();
                            prop_assert!(e.0 || !leaf_evictable, "inner entry {} went while a leaf was evictable", v);
                            e.1 = false;
                        }
                        None => prop_assert!(!m.values().any(|e| e.1), "an evictable entry was left"),
                    }
                }
            }
            prop_assert_eq!(p.len(), m.values().filter(|e| e.1).count());
        }
    }
}
