//! The cache's unit and property tests.

use super::*;
use proptest::prelude::*;
use tokio::time::{Duration, Instant};

const TTL: Duration = Duration::from_secs(60);

fn key(shard: u32, hash: u128) -> Key {
    Key {
        fingerprint: 1,
        salt: 0,
        shard,
        hash,
    }
}

fn cache(pages: u64) -> (Cache, ClassId) {
    cache_with(pages, PolicyKind::Lru)
}

fn cache_with(pages: u64, kind: PolicyKind) -> (Cache, ClassId) {
    let mut c = Cache::new(
        PagePool::new(&kvd_gpu::PoolLayout::new(pages * 1024, 1024).unwrap()),
        kind,
    );
    let class = c.class_for(1024).unwrap();
    (c, class)
}

fn keys(hashes: impl IntoIterator<Item = u128>) -> Vec<Key> {
    hashes.into_iter().map(|h| key(0, h)).collect()
}

/// Looks up `hashes` on shard 0 without pinning; the hit.
fn hit(c: &mut Cache, hashes: impl IntoIterator<Item = u128>) -> u32 {
    let hs: Vec<u128> = hashes.into_iter().collect();
    c.lookup(9, &Query::prefix(1, 0, &[0], &hs), Instant::now(), TTL)
        .0
}

fn store(c: &mut Cache, class: ClassId, keys: &[Key]) -> Vec<StorePlan> {
    let plans = c.begin_store(class, keys);
    let ids: Vec<EntryId> = plans
        .iter()
        .filter_map(|p| match p {
            StorePlan::Write { entry, .. } => Some(*entry),
            _ => None,
        })
        .collect();
    c.finish_store(&ids, true);
    plans
}

#[test]
fn a_lookup_pins_none_of_the_chunks_its_client_holds_and_counts_those_held_below() {
    let (mut c, class) = cache(16);
    let now = Instant::now();
    // Chunks 1-5 in L1 but chunk 2, which a tier below holds.
    store(&mut c, class, &keys([1, 3, 4, 5]));
    let hs = [1, 2, 3, 4, 5, 6];
    let below = [false, true, false];
    // The client holds chunks 1-3: 2 counts though L1 lacks it, and only 4 and 5 are pinned.
    let q = Query::prefix(1, 0, &[0], &hs).pinned(1).holding(3, &below);
    let (hit, pin) = c.lookup(9, &q, now, TTL);
    assert_eq!(hit, 5);
    assert_ne!(pin, 0);
    assert_eq!(c.stats().pinned_pages, 2);
    assert_eq!(c.release_own(9, pin), 2);
    // Held below but not by the client: the hit ends where L1 lacks it.
    let q = Query::prefix(1, 0, &[0], &hs).pinned(1).holding(1, &below);
    assert_eq!(
        c.lookup(9, &q, now, TTL),
        (1, 0),
        "chunk 1 is the client's: nothing pinned"
    );
    // The client holds all five: nothing to pin, the hit reported all the same.
    let q = Query::prefix(1, 0, &[0], &hs).pinned(1).holding(5, &below);
    assert_eq!(c.lookup(9, &q, now, TTL), (5, 0));
    assert_eq!(c.stats().pinned_pages, 0);
}

#[test]
fn lookup_counts_the_prefix_on_every_shard() {
    let (mut c, class) = cache(16);
    let now = Instant::now();
    store(
        &mut c,
        class,
        &[key(0, 1), key(0, 2), key(0, 3), key(1, 1), key(1, 2)],
    );
    assert_eq!(
        c.lookup(9, &Query::prefix(1, 0, &[0], &[1, 2, 3, 4]), now, TTL),
        (3, 0)
    );
    assert_eq!(
        c.lookup(9, &Query::prefix(1, 0, &[0, 1], &[1, 2, 3]), now, TTL)
            .0,
        2
    );
    assert_eq!(
        c.lookup(9, &Query::prefix(1, 0, &[0], &[2, 3]), now, TTL).0,
        2,
        "keys are chained by the client"
    );
    assert_eq!(
        c.lookup(9, &Query::prefix(1, 7, &[0], &[1]), now, TTL).0,
        0,
        "another salt misses"
    );
    assert_eq!(
        c.lookup(9, &Query::prefix(2, 0, &[0], &[1]), now, TTL).0,
        0,
        "another model misses"
    );
    assert_eq!(
        c.lookup(9, &Query::prefix(1, 0, &[], &[1]).pinned(1), now, TTL),
        (0, 0)
    );
}

#[test]
fn lookup_last_finds_the_latest_chunk_stored_on_every_shard_and_pins_it_alone() {
    let (mut c, class) = cache(16);
    let now = Instant::now();
    // A state group: states after chunks 2 and 4 on shard 0, after chunk 2 only on shard 1.
    store(&mut c, class, &[key(0, 2), key(0, 4), key(1, 2)]);
    assert_eq!(
        c.lookup(9, &Query::last(1, 0, &[0], &[1, 2, 3, 4, 5]), now, TTL),
        (4, 0)
    );
    assert_eq!(
        c.lookup(9, &Query::last(1, 0, &[0, 1], &[1, 2, 3, 4, 5]), now, TTL)
            .0,
        2,
        "every shard must hold it"
    );
    assert_eq!(
        c.lookup(9, &Query::last(1, 0, &[0], &[1, 3, 5]), now, TTL),
        (0, 0)
    );
    assert_eq!(
        c.lookup(9, &Query::last(1, 0, &[], &[2]).pinned(1), now, TTL),
        (0, 0)
    );
    let (hit, pin) = c.lookup(
        9,
        &Query::last(1, 0, &[0, 1], &[1, 2, 3]).pinned(1),
        now,
        TTL,
    );
    assert_eq!(hit, 2);
    assert_ne!(pin, 0);
    assert_eq!(
        c.stats().pinned_pages,
        2,
        "chunk 2 on both shards, nothing else"
    );
    assert_eq!(c.release(pin), 2);
    assert_eq!(c.stats().pinned_pages, 0);
}

#[test]
fn writing_entries_are_not_hits_and_failed_stores_vanish() {
    let (mut c, class) = cache(4);
    let now = Instant::now();
    let plans = c.begin_store(class, &[key(0, 1)]);
    let StorePlan::Write { entry, .. } = plans[0] else {
        panic!()
    };
    assert_eq!(c.lookup(1, &Query::prefix(1, 0, &[0], &[1]), now, TTL).0, 0);
    assert_eq!(c.begin_store(class, &[key(0, 1)]), vec![StorePlan::Present]);
    c.finish_store(&[entry], false);
    assert_eq!(c.stats().entries, 0);
    c.check_invariants();
}

#[test]
fn pinned_pages_are_never_evicted_and_a_full_pool_refuses() {
    let (c, class) = cache(4);
    let mut c = c.with_lookup_pin_frac(1.0);
    let now = Instant::now();
    store(&mut c, class, &[key(0, 1), key(0, 2), key(0, 3), key(0, 4)]);
    let (hit, pin) = c.lookup(
        1,
        &Query::prefix(1, 0, &[0], &[1, 2, 3, 4]).pinned(1),
        now,
        TTL,
    );
    assert_eq!((hit, pin != 0), (4, true));
    let plans = c.begin_store(class, &[key(0, 10), key(0, 11)]);
    assert_eq!(
        plans,
        vec![StorePlan::Refused, StorePlan::Refused],
        "every chunk is tried: none is skipped"
    );
    assert_eq!(c.stats().counters.store_refusals, 2);
    assert_eq!(c.stats().counters.refused_pinned, 2);
    assert_eq!(
        c.lookup(1, &Query::prefix(1, 0, &[0], &[1, 2, 3, 4]), now, TTL)
            .0,
        4
    );
    assert_eq!(c.release(pin), 4);
    assert_eq!(c.release(pin), 0);
    let plans = store(&mut c, class, &[key(0, 10)]);
    assert!(matches!(plans[0], StorePlan::Write { .. }));
    assert_eq!(c.stats().counters.evictions, 1);
    assert_eq!(
        c.lookup(1, &Query::prefix(1, 0, &[0], &[1]), now, TTL).0,
        0,
        "LRU victim was chunk 1"
    );
    c.check_invariants();
}

#[test]
fn a_retrieve_releases_its_shard_of_the_pin_after_every_reader() {
    let (mut c, class) = cache(8);
    let now = Instant::now();
    store(&mut c, class, &[key(0, 1), key(0, 2)]);
    let (_, pin) = c.lookup(1, &Query::prefix(1, 0, &[0], &[1, 2]).pinned(2), now, TTL);
    for reader in 0..2 {
        let plans = c.begin_retrieve(class, &[key(0, 1), key(0, 2)], false);
        let ids: Vec<EntryId> = plans.iter().map(|p| p.unwrap().entry).collect();
        assert_eq!(c.stats().pinned_pages, 2);
        c.finish_retrieve(&ids, Some((pin, 0)));
        assert_eq!(c.stats().pin_sets, 1 - reader, "reader {reader}");
    }
    assert_eq!(c.stats().pinned_pages, 0);
    c.check_invariants();
}

#[test]
fn pins_expire_and_die_with_their_session() {
    let (mut c, class) = cache(8);
    let t0 = Instant::now();
    store(&mut c, class, &[key(0, 1)]);
    c.lookup(
        1,
        &Query::prefix(1, 0, &[0], &[1]).pinned(1),
        t0,
        Duration::from_secs(10),
    );
    c.lookup(
        2,
        &Query::prefix(1, 0, &[0], &[1]).pinned(1),
        t0,
        Duration::from_secs(100),
    );
    assert_eq!(c.expire(t0 + Duration::from_secs(9)), 0);
    assert_eq!(c.expire(t0 + Duration::from_secs(10)), 1);
    assert_eq!(c.stats().pinned_pages, 1);
    assert_eq!(c.release_owner(2), 1);
    assert_eq!(c.stats().pinned_pages, 0);
    assert_eq!(c.stats().counters.pins_expired, 1);
    c.check_invariants();
}

#[test]
fn a_new_page_size_takes_slabs_from_another_class() {
    let mut c = Cache::new(
        PagePool::new(&kvd_gpu::PoolLayout::new(4 * 1024, 1024).unwrap()),
        PolicyKind::Lru,
    );
    let small = c.class_for(512).unwrap();
    let big = c.class_for(1024).unwrap();
    store(
        &mut c,
        small,
        &(0..8).map(|h| key(0, h)).collect::<Vec<_>>(),
    );
    let plans = store(&mut c, big, &[key(1, 100)]);
    assert!(matches!(plans[0], StorePlan::Write { .. }));
    assert_eq!(
        c.stats().counters.evictions,
        2,
        "one slab of two small pages"
    );
    c.check_invariants();
}

/// A pool of `slabs` slabs of 1 KiB and two page classes: model A's 256-byte pages (four
/// per slab) and model B's 1 KiB pages (one per slab).
fn two_models(slabs: u64) -> (Cache, ClassId, ClassId) {
    let mut c = Cache::new(
        PagePool::new(&kvd_gpu::PoolLayout::new(slabs * 1024, 1024).unwrap()),
        PolicyKind::Lru,
    );
    let a = c.class_for(256).unwrap();
    let b = c.class_for(1024).unwrap();
    (c, a, b)
}

/// How many of `hashes` on `shard` are hits (a prefix count, without pinning).
fn hits(c: &mut Cache, shard: u32, hashes: impl IntoIterator<Item = u128>) -> u32 {
    let hs: Vec<u128> = hashes.into_iter().collect();
    c.lookup(9, &Query::prefix(1, 0, &[shard], &hs), Instant::now(), TTL)
        .0
}

#[test]
fn a_model_that_starts_after_the_pool_filled_grows_into_it() {
    // Model A (small pages, shard 0) fills all 16 slabs; then model B (page = slab, shard 1)
    // stores while A is idle. B must end up with the pool, not the one slab it could take.
    let (mut c, a, b) = two_models(16);
    store(&mut c, a, &(0..64).map(|h| key(0, h)).collect::<Vec<_>>());
    assert_eq!(c.pool.class_slabs(a), 16);
    for h in 0..16 {
        let plans = store(&mut c, b, &[key(1, 1000 + h)]);
        assert!(
            matches!(plans[0], StorePlan::Write { .. }),
            "store {h}: {plans:?}"
        );
        c.check_invariants();
    }
    assert_eq!(c.pool.class_slabs(b), 16);
    assert_eq!(hits(&mut c, 1, 1000..1016), 16, "every chunk of B is kept");
    assert_eq!(hits(&mut c, 0, 0..64), 0);
}

#[test]
fn another_class_keeps_its_slabs_while_its_data_is_younger() {
    let (mut c, a, b) = two_models(4);
    store(&mut c, b, &[key(1, 1), key(1, 2)]);
    store(&mut c, a, &(0..8).map(|h| key(0, h)).collect::<Vec<_>>());
    // A's chunks are read after B's were stored: B evicts its own oldest chunk.
    assert_eq!(hits(&mut c, 0, 0..8), 8);
    store(&mut c, b, &[key(1, 3)]);
    assert_eq!(hits(&mut c, 0, 0..8), 8);
    assert_eq!(hits(&mut c, 1, [1]), 0);
    assert_eq!(hits(&mut c, 1, [2]), 1);
    // Now B's chunks are the younger ones: the next store of B takes one of A's slabs.
    assert_eq!(hits(&mut c, 1, [2]), 1);
    assert_eq!(hits(&mut c, 1, [3]), 1);
    store(&mut c, b, &[key(1, 4)]);
    assert_eq!(
        hits(&mut c, 1, [2]) + hits(&mut c, 1, [3]) + hits(&mut c, 1, [4]),
        3
    );
    assert_eq!(
        hits(&mut c, 0, 0..8),
        0,
        "A's oldest chunks (and their slab-mates) went"
    );
    c.check_invariants();
}

#[test]
fn a_slab_holding_a_pinned_page_is_not_taken() {
    let (mut c, a, b) = two_models(2);
    store(&mut c, a, &(0..8).map(|h| key(0, h)).collect::<Vec<_>>());
    // Pin A's oldest chunk (in slab 0) as a lookup would before a retrieve.
    let (n, pin) = c.lookup(
        9,
        &Query::prefix(1, 0, &[0], &[0]).pinned(1),
        Instant::now(),
        TTL,
    );
    assert_eq!((n, pin != 0), (1, true));
    let plans = store(&mut c, b, &[key(1, 100)]);
    assert!(matches!(plans[0], StorePlan::Write { .. }));
    // Slab 1 moved to B; slab 0 kept its pinned chunk.
    assert_eq!(hits(&mut c, 0, [0]), 1);
    assert_eq!(c.pool.class_slabs(b), 1);
    c.check_invariants();
}

#[derive(Debug, Clone)]
enum Op {
    Store(u8, Vec<u8>),
    Fill(u8, Vec<u8>),
    Lookup(Vec<u8>, bool),
    Retrieve(u8, Vec<u8>),
    Release(u8),
    Expire(u8),
    EndSession,
    Grow,
    /// The disk tier gives back the pages handed to it.
    Written,
}

fn op() -> impl Strategy<Value = Op> {
    let hashes = proptest::collection::vec(0u8..24, 1..6);
    prop_oneof![
        4 => (0u8..2, hashes.clone()).prop_map(|(c, h)| Op::Store(c, h)),
        2 => (0u8..2, hashes.clone()).prop_map(|(c, h)| Op::Fill(c, h)),
        3 => (hashes.clone(), any::<bool>()).prop_map(|(h, p)| Op::Lookup(h, p)),
        2 => (0u8..2, hashes).prop_map(|(c, h)| Op::Retrieve(c, h)),
        1 => any::<u8>().prop_map(Op::Release),
        1 => (0u8..30).prop_map(Op::Expire),
        1 => Just(Op::EndSession),
        1 => Just(Op::Grow),
        2 => Just(Op::Written),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Under every policy, any sequence of operations keeps the index, pool, pins and policy
    /// consistent, and a lookup hit that was ready is never missed by a retrieve while pinned
    /// (one still being filled from disk may fail its fill).
    #[test]
    fn invariants_hold(
        kind in prop_oneof![Just(PolicyKind::Lru), Just(PolicyKind::Fifo), Just(PolicyKind::S3Fifo), Just(PolicyKind::Prefix), Just(PolicyKind::PrefixReuse)],
        pin_frac in prop_oneof![Just(0.25), Just(0.5), Just(1.0)],
        hold_frac in prop_oneof![Just(0.0), Just(0.25), Just(1.0)],
        disk in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        // The pool starts with 2 of its 6 slabs and grows while the cache serves.
        let mut c = Cache::new(PagePool::growing(&kvd_gpu::PoolLayout::new(6 * 2048, 2048).unwrap()), kind)
            .with_lookup_pin_frac(pin_frac)
            .with_lookup_holds(hold_frac, Duration::from_secs(15));
        c.grow_pool(2);
        let (kick, _kicked) = crossbeam_channel::unbounded();
        if disk {
            c.enable_demotion(2 * 2048, kick);
        }
        let mut demoted: Vec<EntryId> = Vec::new();
        let classes = [c.class_for(1024).unwrap(), c.class_for(700).unwrap()];
        let t0 = Instant::now();
        let mut now = t0;
        let mut pins: Vec<(u64, Vec<u128>)> = Vec::new();
        let mut writing: Vec<Vec<EntryId>> = Vec::new();
        for op in ops {
            match op {
                Op::Store(ci, hs) => {
                    let keys: Vec<Key> = hs.iter().map(|&h| key(ci as u32, h as u128)).collect();
                    let plans = c.begin_store(classes[ci as usize], &keys);
                    writing.push(plans.iter().filter_map(|p| match p { StorePlan::Write { entry, .. } => Some(*entry), _ => None }).collect());
                    // Finish the oldest store half the time, so some stay in flight.
                    if writing.len() > 1 {
                        let ids = writing.remove(0);
                        c.finish_store(&ids, hs.len() % 3 != 0);
                    }
                }
                Op::Fill(ci, hs) => {
                    let keys: Vec<Key> = hs.iter().map(|&h| key(ci as u32, h as u128)).collect();
                    let plans = c.begin_fill(classes[ci as usize], &keys);
                    writing.push(plans.iter().filter_map(|p| match p { StorePlan::Write { entry, .. } => Some(*entry), _ => None }).collect());
                    if writing.len() > 1 {
                        let ids = writing.remove(0);
                        c.finish_store(&ids, hs.len() % 2 != 0);
                    }
                }
                Op::Lookup(hs, pin) => {
                    let hs: Vec<u128> = hs.iter().map(|&h| h as u128).collect();
                    let q = Query::prefix(1, 0, &[0], &hs);
                    let q = if pin { q.pinned(1) } else { q };
                    let (n, pin_id) = c.lookup(1, &q, now, Duration::from_secs(10));
                    if pin_id != 0 {
                        // Only the head that fit in the lookup pins' share is pinned.
                        let pinned = c.pins[&pin_id].shards[0].entries.len();
                        assert!(pinned <= n as usize);
                        let ready = hs[..pinned].iter().copied().filter(|&h| c.ready(&key(0, h)).is_some()).collect();
                        pins.push((pin_id, ready));
                    }
                }
                Op::Retrieve(ci, hs) => {
                    let keys: Vec<Key> = hs.iter().map(|&h| key(ci as u32, h as u128)).collect();
                    let plans = c.begin_retrieve(classes[ci as usize], &keys, true);
                    let ids: Vec<EntryId> = plans.iter().flatten().map(|p| p.entry).collect();
                    c.finish_retrieve(&ids, None);
                }
                Op::Release(i) if !pins.is_empty() => {
                    let (id, _) = pins.remove(i as usize % pins.len());
                    c.release(id);
                }
                Op::Release(_) => {}
                Op::Expire(secs) => {
                    now += Duration::from_secs(secs as u64);
                    c.expire(now);
                    pins.retain(|(id, _)| c.pins.contains_key(id));
                }
                Op::EndSession => {
                    c.release_owner(1);
                    pins.clear();
                }
                Op::Grow => {
                    let slabs = c.pool.ready_slabs() + 1;
                    c.grow_pool(slabs);
                }
                Op::Written => {
                    demoted.extend(c.take_demotions().iter().map(|d| d.ticket));
                    c.finish_demotions(&std::mem::take(&mut demoted));
                }
            }
            c.check_invariants();
            // Every chunk under a live pin is still a hit.
            for (_, hs) in &pins {
                let keys: Vec<Key> = hs.iter().map(|&h| key(0, h)).collect();
                let plans = c.begin_retrieve(classes[0], &keys, false);
                prop_assert!(plans.iter().all(Option::is_some));
                let ids: Vec<EntryId> = plans.iter().flatten().map(|p| p.entry).collect();
                c.finish_retrieve(&ids, None);
            }
        }
    }
}

#[test]
fn the_prefix_policy_evicts_a_prefix_tail_first() {
    let (mut c, class) = cache_with(4, PolicyKind::Prefix);
    store(&mut c, class, &keys(1..=4));
    assert_eq!(hit(&mut c, 1..=4), 4);
    store(&mut c, class, &keys([10]));
    assert_eq!(hit(&mut c, 1..=4), 3, "the tail went");
    assert_eq!(c.stats().unreachable_chunks, 0);
    c.check_invariants();
}

#[test]
fn lru_takes_the_head_and_the_rest_is_counted_unreachable() {
    let (mut c, class) = cache(4);
    store(&mut c, class, &keys(1..=4));
    assert_eq!(hit(&mut c, 1..=4), 4);
    store(&mut c, class, &keys([10]));
    assert_eq!(hit(&mut c, 1..=4), 0, "LRU took the head");
    let s = c.stats();
    assert_eq!((s.unreachable_chunks, s.unreachable_bytes), (3, 3 * 1024));
    // Its next store (the head again) takes the next-oldest chunk: the head of what is left.
    store(&mut c, class, &keys([1]));
    assert_eq!(hit(&mut c, 1..=4), 1);
    assert_eq!(c.stats().unreachable_chunks, 2);
    c.check_invariants();
}

#[test]
fn storing_the_missing_chunk_makes_the_rest_reachable() {
    let (mut c, class) = cache_with(8, PolicyKind::Prefix);
    assert_eq!(hit(&mut c, [1, 2, 3]), 0);
    // Chunks 2 and 3 stored without 1 (its store was refused, say).
    store(&mut c, class, &keys([2, 3]));
    assert_eq!(c.stats().unreachable_chunks, 2);
    store(&mut c, class, &keys([1]));
    assert_eq!(c.stats().unreachable_chunks, 0);
    assert_eq!(hit(&mut c, [1, 2, 3]), 3);
    c.check_invariants();
}

#[test]
fn a_conversation_idle_longest_loses_its_tail_first() {
    let (mut c, class) = cache_with(6, PolicyKind::Prefix);
    store(&mut c, class, &keys([1, 2, 3]));
    store(&mut c, class, &keys([11, 12, 13]));
    // Conversation 1 comes back with two chunks more; conversation 11 is idle.
    assert_eq!(hit(&mut c, [1, 2, 3, 4, 5]), 3);
    store(&mut c, class, &keys([4, 5]));
    assert_eq!(hit(&mut c, [11, 12, 13]), 1, "11's tail went, tail first");
    assert_eq!(hit(&mut c, [1, 2, 3, 4, 5]), 5);
    assert_eq!(c.stats().unreachable_chunks, 0);
    c.check_invariants();
}

#[test]
fn conversations_asked_for_and_not_read_yet_keep_the_pool_they_hold() {
    // Three conversations of two chunks, each looked up (nothing found) and then stored, in a
    // pool of four pages and before any read: the third takes the pages of the newest one
    // held, so the first is kept whole for when it comes back (a loop larger than the pool,
    // where taking the oldest first keeps nothing that is read again).
    let (mut c, class) = cache_with(4, PolicyKind::PrefixReuse);
    for conv in [[1, 2], [11, 12], [21, 22]] {
        assert_eq!(hit(&mut c, conv), 0);
        store(&mut c, class, &keys(conv));
        c.check_invariants();
    }
    assert_eq!(hit(&mut c, [1, 2]), 2, "the first conversation is kept");
    assert_eq!(hit(&mut c, [21, 22]), 2, "the one being stored is kept");
    assert_eq!(hit(&mut c, [11, 12]), 0);
    // Chunks stored without a lookup asking for them (a client that stores and retrieves by
    // key) keep the oldest-first order: a burst of such stores must not evict itself.
    let (mut c, class) = cache_with(4, PolicyKind::PrefixReuse);
    for conv in [[1, 2], [11, 12], [21, 22]] {
        store(&mut c, class, &keys(conv));
    }
    assert_eq!(hit(&mut c, [11, 12]), 2);
    assert_eq!(hit(&mut c, [21, 22]), 2);
    assert_eq!(hit(&mut c, [1, 2]), 0);
    c.check_invariants();
}

#[test]
fn a_store_after_a_lookup_is_linked_to_the_hit() {
    // The connector stores only the chunks computed since the hit: the lookup names the first
    // stored chunk's parent.
    let (mut c, class) = cache_with(4, PolicyKind::Prefix);
    store(&mut c, class, &keys([1, 2]));
    assert_eq!(hit(&mut c, [1, 2, 3, 4]), 2);
    store(&mut c, class, &keys([3, 4]));
    assert_eq!(hit(&mut c, [1, 2, 3, 4]), 4);
    store(&mut c, class, &keys([20]));
    assert_eq!(hit(&mut c, [1, 2, 3, 4]), 3, "chunk 4 was the leaf");
    // 3 and 4, each named by a lookup that did not find it (4 twice, one hint).
    assert_eq!(c.hints.len(), 2);
    c.check_invariants();
}

#[test]
fn a_shared_head_stays_while_a_branch_is_held() {
    let (mut c, class) = cache_with(5, PolicyKind::Prefix);
    store(&mut c, class, &keys([1, 2, 3]));
    assert_eq!(hit(&mut c, [1, 100, 101]), 1);
    store(&mut c, class, &keys([100, 101]));
    // Branch 2..3 is older than branch 100..101.
    store(&mut c, class, &keys([50]));
    store(&mut c, class, &keys([51]));
    assert_eq!(
        hit(&mut c, [1, 2, 3]),
        1,
        "the older branch went tail first"
    );
    assert_eq!(hit(&mut c, [1, 100, 101]), 3);
    c.check_invariants();
}

#[test]
fn lookup_pins_hold_at_most_their_share_and_stores_still_get_pages() {
    let (mut c, class) = cache(8);
    let now = Instant::now();
    store(&mut c, class, &keys(1..=8));
    let (n, pin) = c.lookup(
        1,
        &Query::prefix(1, 0, &[0], &(1..=8).collect::<Vec<_>>()).pinned(1),
        now,
        TTL,
    );
    assert_eq!((n, pin != 0), (8, true), "the whole hit is reported");
    assert_eq!(c.stats().pinned_pages, 4, "half the pool is pinned");
    assert_eq!(c.stats().counters.pin_budget_chunks, 4);
    let (n, pin2) = c.lookup(1, &Query::prefix(1, 0, &[0], &[1]).pinned(1), now, TTL);
    assert_eq!((n, pin2), (1, 0), "reported, but no room left for a pin");
    let plans = store(&mut c, class, &keys(20..24));
    assert!(plans.iter().all(|p| matches!(p, StorePlan::Write { .. })));
    assert_eq!(hit(&mut c, 1..=4), 4, "the pinned chunks stayed");
    c.release(pin);
    let (n, pin3) = c.lookup(1, &Query::prefix(1, 0, &[0], &[1]).pinned(1), now, TTL);
    assert_eq!((n, pin3 != 0), (1, true));
    c.check_invariants();
}

#[test]
fn a_last_lookup_past_the_pin_share_is_reported_held_like_a_prefix_lookup() {
    let (c, class) = cache(8);
    let mut c = c
        .with_lookup_pin_frac(0.25)
        .with_lookup_holds(0.5, Duration::from_secs(10));
    let now = Instant::now();
    store(&mut c, class, &keys(1..=8));
    let (n, pin) = c.lookup(1, &Query::prefix(1, 0, &[0], &[1, 2]).pinned(1), now, TTL);
    assert_eq!((n, pin != 0), (2, true), "the share: two pages");
    let (n, pin) = c.lookup(1, &Query::last(1, 0, &[0], &[3, 9, 5]).pinned(1), now, TTL);
    assert_eq!(
        (n, pin),
        (3, 0),
        "chunk 5, the third, reported without a pin"
    );
    let s = c.stats();
    assert_eq!(s.counters.pin_budget_chunks, 1);
    assert_eq!(
        s.held_chunks, 1,
        "and held until its retrieve, as a prefix's tail is"
    );
    assert_eq!(retrieved(&mut c, class, [5]), 1);
    assert_eq!(c.stats().held_chunks, 0);
    c.check_invariants();
}

#[test]
fn hints_are_bounded() {
    let mut h = hints::Hints::default();
    for i in 0..100u128 {
        h.remember(1, 0, i + 1, Some(i), 10);
    }
    assert_eq!(h.len(), 10);
    assert_eq!(h.parent_of(&key(0, 100)), Some(99));
    assert_eq!(h.parent_of(&key(0, 50)), None);
}

#[test]
fn evicted_and_failed_chunks_are_in_the_feed_and_nothing_else() {
    let (mut c, class) = cache_with(4, PolicyKind::Lru);
    store(&mut c, class, &[key(0, 1), key(0, 2), key(0, 3), key(0, 4)]);
    assert_eq!(
        c.removals().head(),
        0,
        "storing into free pages removes nothing"
    );
    store(&mut c, class, &[key(0, 5), key(0, 6)]);
    let plans = c.begin_store(class, &[key(0, 7)]);
    let StorePlan::Write { entry, .. } = plans[0] else {
        panic!("{plans:?}")
    };
    c.finish_store(&[entry], false);
    let feed = c.removals().read(0, 100);
    assert_eq!(
        feed.records,
        vec![key(0, 1), key(0, 2), key(0, 3), key(0, 7)],
        "the two LRU victims, then 3 evicted for 7, then 7 whose copy failed"
    );
    assert_eq!((feed.next, feed.dropped), (4, 0));
    c.check_invariants();
}

/// Retrieves `hashes` on shard 0; how many were there.
fn retrieved(c: &mut Cache, class: ClassId, hashes: impl IntoIterator<Item = u128>) -> usize {
    retrieved_by(c, class, hashes, false)
}

/// Retrieves `hashes` on shard 0, by key (`by_key`: no lookup pinned them) or not.
fn retrieved_by(
    c: &mut Cache,
    class: ClassId,
    hashes: impl IntoIterator<Item = u128>,
    by_key: bool,
) -> usize {
    let plans = c.begin_retrieve(class, &keys(hashes), by_key);
    let ids: Vec<EntryId> = plans.iter().flatten().map(|p| p.entry).collect();
    c.finish_retrieve(&ids, None);
    ids.len()
}

#[test]
fn chunks_reported_past_the_pin_budget_are_held_until_their_retrieve() {
    for kind in [
        PolicyKind::Lru,
        PolicyKind::Fifo,
        PolicyKind::S3Fifo,
        PolicyKind::Prefix,
        PolicyKind::PrefixReuse,
    ] {
        let (c, class) = cache_with(8, kind);
        let mut c = c
            .with_lookup_pin_frac(0.25)
            .with_lookup_holds(0.5, Duration::from_secs(10));
        let now = Instant::now();
        store(&mut c, class, &keys(1..=8));
        let all: Vec<u128> = (1..=8).collect();
        let (n, pin) = c.lookup(1, &Query::prefix(1, 0, &[0], &all).pinned(1), now, TTL);
        assert_eq!(
            (n, pin != 0),
            (8, true),
            "{kind:?}: the whole hit is reported"
        );
        let s = c.stats();
        // Two new chunks (a fill from disk, another request's store) take 7 and 8, whatever
        // the policy would rather evict.
        store(&mut c, class, &keys(20..22));
        c.check_invariants();
        assert_eq!(
            retrieved(&mut c, class, 3..=6),
            4,
            "{kind:?}: every held chunk is there"
        );
        assert_eq!(s.pinned_pages, 2, "{kind:?}: 1 and 2 pinned");
        assert_eq!(
            s.held_chunks, 4,
            "{kind:?}: 3 to 6 held, up to half the pool"
        );
        assert_eq!(
            s.counters.hold_budget_chunks, 2,
            "{kind:?}: 7 and 8 not held"
        );
        assert_eq!(
            c.stats().held_chunks,
            0,
            "{kind:?}: a retrieve ends the hold"
        );
        assert_eq!(c.stats().counters.holds_evicted, 0);
        c.check_invariants();
    }
}

#[test]
fn a_store_takes_a_held_chunk_rather_than_be_refused() {
    let (c, class) = cache_with(8, PolicyKind::Fifo);
    let mut c = c
        .with_lookup_pin_frac(0.5)
        .with_lookup_holds(0.5, Duration::from_secs(10));
    let now = Instant::now();
    store(&mut c, class, &keys(1..=8));
    let (n, _) = c.lookup(
        1,
        &Query::prefix(1, 0, &[0], &(1..=8).collect::<Vec<_>>()).pinned(1),
        now,
        TTL,
    );
    assert_eq!(n, 8);
    assert_eq!(
        c.stats().held_chunks,
        4,
        "half pinned, half held: nothing else to evict"
    );
    let plans = store(&mut c, class, &keys(20..23));
    assert!(plans.iter().all(|p| matches!(p, StorePlan::Write { .. })));
    let s = c.stats();
    assert_eq!(
        s.counters.holds_evicted, 3,
        "the oldest holds went, counted"
    );
    assert_eq!(s.counters.store_refusals, 0);
    assert_eq!(retrieved(&mut c, class, [8]), 1, "the newest hold stayed");
    c.check_invariants();
}

#[test]
fn holds_run_out_and_their_chunks_are_evictable_again() {
    let (c, class) = cache_with(8, PolicyKind::Fifo);
    let mut c = c
        .with_lookup_pin_frac(0.25)
        .with_lookup_holds(0.5, Duration::from_secs(10));
    let t0 = Instant::now();
    store(&mut c, class, &keys(1..=8));
    let (_, pin) = c.lookup(
        1,
        &Query::prefix(1, 0, &[0], &[1, 2, 3, 4]).pinned(1),
        t0,
        TTL,
    );
    assert_eq!(c.stats().held_chunks, 2);
    c.expire(t0 + Duration::from_secs(5));
    assert_eq!(c.stats().held_chunks, 2, "not yet");
    c.expire(t0 + Duration::from_secs(10));
    assert_eq!(c.stats().held_chunks, 0);
    c.check_invariants();
    // Evictable like any chunk again: six new chunks take every unpinned page.
    store(&mut c, class, &keys(20..26));
    assert_eq!(retrieved(&mut c, class, [3, 4]), 0);
    assert_eq!(c.stats().counters.holds_evicted, 0);
    c.release(pin);
    c.check_invariants();
}

#[test]
fn a_held_chunk_pinned_meanwhile_is_held_again_when_unpinned() {
    let (c, class) = cache_with(8, PolicyKind::Fifo);
    let mut c = c
        .with_lookup_pin_frac(0.25)
        .with_lookup_holds(0.5, Duration::from_secs(10));
    let now = Instant::now();
    store(&mut c, class, &keys(1..=8));
    c.lookup(
        1,
        &Query::prefix(1, 0, &[0], &[1, 2, 3]).pinned(1),
        now,
        TTL,
    );
    assert_eq!(c.stats().held_chunks, 1, "3 is held");
    // A copy to L2 pins 3 for a moment; the hold outlives it.
    let (plan, _) = c.pin_ready(&key(0, 3)).unwrap();
    c.check_invariants();
    c.finish_retrieve(&[plan.entry], None);
    assert_eq!(c.stats().held_chunks, 1);
    store(&mut c, class, &keys(20..21));
    assert_eq!(retrieved(&mut c, class, [3]), 1);
    c.check_invariants();
}

/// With every chunk pinned or held, a store takes a page of the disk tier's reserve, and then
/// sends a chunk neither pinned nor held to the disk, before it takes a held chunk.
#[test]
fn with_a_disk_tier_a_store_takes_the_reserve_before_a_held_chunk() {
    let (c, class) = cache_with(8, PolicyKind::Fifo);
    let mut c = c
        .with_lookup_pin_frac(0.25)
        .with_lookup_holds(0.5, Duration::from_secs(10));
    let (tx, _rx) = crossbeam_channel::bounded(1);
    c.enable_demotion(2 * 1024, tx);
    let now = Instant::now();
    store(&mut c, class, &keys(1..=6));
    c.lookup(
        1,
        &Query::prefix(1, 0, &[0], &[1, 2, 3, 4, 5, 6]).pinned(1),
        now,
        TTL,
    );
    let held = c.stats().held_chunks;
    for h in 20..22 {
        store(&mut c, class, &keys([h]));
    }
    c.check_invariants();
    // The second store keeps the reserve by sending the first to the disk: the only chunk
    // neither pinned nor held.
    let demoted: Vec<u128> = c.take_demotions().iter().map(|d| d.key.hash).collect();
    assert_eq!(demoted, vec![20]);
    assert_eq!(c.stats().counters.store_refusals, 0);
    assert_eq!(retrieved(&mut c, class, 3..=6), 4);
    assert_eq!(held, 4, "3 to 6 were held");
    c.check_invariants();
}

/// A hot set of `hot` chunks (prefixes of `per` chunks) stored by key into a pool of `pages`,
/// read once, then re-read round and round by key (a retrieve alone, as a client that stores
/// and retrieves by key does) while a stream of never-read chunks (`stream_per_read` stores of
/// `per`-chunk prefixes per hot prefix read) flows through `10 × pages` chunks; the hot chunks
/// the reads missed.
fn hot_set_misses(kind: PolicyKind, pages: u64, hot: u64, per: u64, stream_per_read: u64) -> u64 {
    let (mut c, class) = cache_with(pages, kind);
    let prefixes: Vec<Vec<u128>> = (0..hot / per)
        .map(|p| {
            (0..per)
                .map(|i| 1_000_000 + (p * per + i) as u128)
                .collect()
        })
        .collect();
    for p in &prefixes {
        store(&mut c, class, &keys(p.iter().copied()));
    }
    // Read once: a hot set is one that is read again.
    for p in &prefixes {
        retrieved_by(&mut c, class, p.iter().copied(), true);
    }
    let mut misses = 0;
    let mut next = 10_000_000u128;
    let mut streamed = 0;
    let mut p = 0;
    while streamed < 10 * pages {
        let want = &prefixes[p % prefixes.len()];
        p += 1;
        misses += per - retrieved_by(&mut c, class, want.iter().copied(), true) as u64;
        for _ in 0..stream_per_read {
            let chain: Vec<u128> = (0..per as u128).map(|i| next + i).collect();
            next += per as u128;
            streamed += per;
            store(&mut c, class, &keys(chain));
        }
    }
    c.check_invariants();
    misses
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// The data-plane benchmark's interference: a client re-reads its hot set by key (a
    /// retrieve alone, no lookup) while a stream of chunks that are never read is stored at any
    /// rate. A hot set of up to half the pool, read once and then round and round, loses no
    /// chunk to a stream of ten times the pool with the default policy (and with s3fifo; the
    /// recency policies keep it only while the stream stores less than the free half of the
    /// pool between two reads of a hot chunk).
    #[test]
    fn a_hot_set_read_by_key_survives_a_stream_of_ten_pools(
        pages in 16u64..128,
        hot_frac in 1u64..=100,
        per in 1u64..=4,
        stream_per_read in 1u64..=16,
    ) {
        let hot = ((pages / 2) * hot_frac / 100 / per).max(1) * per;
        for kind in [PolicyKind::PrefixReuse, PolicyKind::S3Fifo] {
            let misses = hot_set_misses(kind, pages, hot, per, stream_per_read);
            prop_assert_eq!(misses, 0, "{:?}: pool {} hot {} per {} stream/read {}", kind, pages, hot, per, stream_per_read);
        }
    }
}

#[test]
fn the_recency_policies_lose_a_hot_set_to_a_stream_faster_than_its_reads() {
    // What docs/flags.md (`--eviction`) says of the other policies: with 32 of 64 pages hot in
    // prefixes of 4, and 4 stream prefixes stored per hot prefix read, they lose hot chunks.
    for kind in [PolicyKind::Prefix, PolicyKind::Lru, PolicyKind::Fifo] {
        assert!(hot_set_misses(kind, 64, 32, 4, 4) > 0, "{kind:?}");
    }
    assert_eq!(hot_set_misses(PolicyKind::PrefixReuse, 64, 32, 4, 4), 0);
}

#[test]
fn a_store_takes_no_page_for_a_chunk_a_tier_below_holds_and_l1_lacks() {
    let (mut c, class) = cache(4);
    store(&mut c, class, &keys([1]));
    // Chunk 1 is in L1, 2 only below, 3 in neither: only 3 is written.
    let plans = c.begin_store_above(class, &keys([1, 2, 3]), None, true, &[true, true, false]);
    assert_eq!(plans[..2], [StorePlan::Present, StorePlan::Present]);
    let StorePlan::Write { entry, .. } = plans[2] else {
        panic!("{plans:?}")
    };
    c.finish_store(&[entry], true);
    assert_eq!(c.stats().entries, 2);
    assert_eq!(hit(&mut c, [1, 2, 3]), 1, "L1 holds 1 and 3, not 2");
    c.check_invariants();
}
