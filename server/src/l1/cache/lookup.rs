//! Lookups, one query type for both kinds: the longest prefix of a token sequence stored on
//! every shard, or the last chunk of a state group; what a lookup teaches the prefix tree about
//! parents (and the hints it leaves for a store that starts where the hit ended), and the
//! touch-free prefixes the lower tiers ask for before they fetch.

use tokio::time::{Duration, Instant};

use super::{hints, set_leaf, Cache, Key, SessionId};
use crate::l1::evict::EntryId;

/// Which of a lookup's chunks it asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// The longest prefix stored on every shard: ready, or being read back from disk (a
    /// retrieve waits for those).
    Prefix,
    /// The last chunk stored on every shard, alone: a state group's chunk stands alone
    /// (protocol `LookupLast`). Only ready chunks count.
    Last,
}

/// One lookup: the chunks named by `fingerprint`, `salt`, each of `shards` and each of
/// `hashes`, which of them it wants, and whether to pin what it finds.
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    /// Model and layout fingerprint.
    pub fingerprint: u64,
    /// Hash of the cache salt.
    pub salt: u64,
    /// The shards that must all hold a chunk for it to count.
    pub shards: &'a [u32],
    /// Chained chunk hashes, in prompt order.
    pub hashes: &'a [u128],
    /// What it wants of them.
    pub want: Want,
    /// Pin the hit for this many readers per shard (its retrieves); `None`: only report it.
    pub pin: Option<u16>,
    /// Leading chunks the client holds already (vLLM's own prefix cache) and will not
    /// retrieve: found, they are touched but not pinned.
    pub held: usize,
    /// For chunks before `held`, whether a tier below L1 holds it on every shard: one that L1
    /// lacks still counts towards the hit (the client loads none of them), with no entry.
    pub below: &'a [bool],
}

impl<'a> Query<'a> {
    /// A lookup of the longest stored prefix of `hashes`, not pinned.
    pub fn prefix(fingerprint: u64, salt: u64, shards: &'a [u32], hashes: &'a [u128]) -> Self {
        Query {
            fingerprint,
            salt,
            shards,
            hashes,
            want: Want::Prefix,
            pin: None,
            held: 0,
            below: &[],
        }
    }

    /// A lookup of the last stored chunk of `hashes`, not pinned.
    pub fn last(fingerprint: u64, salt: u64, shards: &'a [u32], hashes: &'a [u128]) -> Self {
        Query {
            want: Want::Last,
            ..Query::prefix(fingerprint, salt, shards, hashes)
        }
    }

    /// The same lookup, pinning its hit for `readers` retrieves per shard.
    pub fn pinned(self, readers: u16) -> Self {
        Query {
            pin: Some(readers),
            ..self
        }
    }

    /// The same lookup from a client that holds the first `held` chunks already, `below`
    /// saying which of them a tier below L1 holds.
    pub fn holding(self, held: usize, below: &'a [bool]) -> Self {
        Query {
            held,
            below,
            ..self
        }
    }

    fn key(&self, shard: u32, hash: u128) -> Key {
        Key {
            fingerprint: self.fingerprint,
            salt: self.salt,
            shard,
            hash,
        }
    }
}

impl Cache {
    /// Answers lookup `q` for session `owner`. Returns the hit and the pin id (0 for none):
    /// for [`Want::Prefix`] the prefix's length, for [`Want::Last`] one more than the found
    /// chunk's position, 0 when nothing is found. The chunks found count as read; with
    /// [`Query::pin`] those after [`Query::held`] are pinned until their retrieves (`ttl` at
    /// most) as far as the lookup pins' share allows, and the rest is held (`holds`).
    pub fn lookup(
        &mut self,
        owner: SessionId,
        q: &Query<'_>,
        now: Instant,
        ttl: Duration,
    ) -> (u32, u64) {
        if q.shards.is_empty() {
            return (0, 0);
        }
        // The chunks found, one list per shard (`None`: held below L1 only), and the hit.
        let (reported, found) = match q.want {
            Want::Prefix => {
                let found = self.prefix_hit(q);
                self.learn_parents(q.fingerprint, q.salt, q.shards, q.hashes, &found);
                (found.first().map_or(0, Vec::len) as u32, found)
            }
            Want::Last => match self.last_hit(q) {
                Some((i, ids)) => (
                    (i + 1) as u32,
                    ids.into_iter().map(|id| vec![Some(id)]).collect(),
                ),
                None => return (0, 0),
            },
        };
        if reported == 0 {
            return (0, 0);
        }
        for &id in found.iter().flatten().flatten() {
            self.touch(id);
        }
        let Some(readers) = q.pin else {
            return (reported, 0);
        };
        // What the client retrieves: the hit after the chunks it holds, all in L1.
        let mut hit: Vec<Vec<EntryId>> = found
            .into_iter()
            .map(|per_shard| per_shard.into_iter().skip(q.held).flatten().collect())
            .collect();
        let found = hit.first().map_or(0, Vec::len);
        if found == 0 {
            return (reported, 0);
        }
        // Pin the head of the hit that fits in the lookup pins' share; the rest is reported
        // but unpinned, so stores may evict it (its retrieve then finds it missing and vLLM
        // recomputes from there, as it would have had the hit been reported shorter). It is
        // held meanwhile: evicted only when nothing else can be (`holds`).
        let room = self.lookup_pin_room(hit[0][0]) as usize / q.shards.len();
        let pinned = found.min(room);
        if pinned < found {
            self.counters.pin_budget_chunks += (found - pinned) as u64;
            let unpinned: Vec<EntryId> = hit
                .iter_mut()
                .flat_map(|per_shard| per_shard.drain(pinned..))
                .collect();
            self.hold_reported(unpinned, now);
        }
        if pinned == 0 {
            return (reported, 0);
        }
        let pin_id = self.pin_lookup(owner, q.shards, hit, readers, now, ttl);
        (reported, pin_id)
    }

    /// The longest prefix of `q`'s hashes available on every shard, one list per shard: each
    /// chunk's entry, or `None` for one the client holds that L1 lacks and a tier below holds
    /// ([`Query::below`]). Chunks whose pages are being written to disk are taken back on the
    /// way ([`Cache::take_back`]), where every shard has the chunk one way or the other.
    fn prefix_hit(&mut self, q: &Query<'_>) -> Vec<Vec<Option<EntryId>>> {
        let mut hit: Vec<Vec<Option<EntryId>>> = vec![Vec::new(); q.shards.len()];
        for (i, &hash) in q.hashes.iter().enumerate() {
            let below = i < q.held && q.below.get(i) == Some(&true);
            let ids = self.chunk_in_l1(q, i, hash);
            if ids.is_none() && !below {
                break;
            }
            for (s, per_shard) in hit.iter_mut().enumerate() {
                per_shard.push(ids.as_ref().map(|ids| ids[s]));
            }
        }
        hit
    }

    /// Chunk `i` (`hash`) of `q` on every shard, when L1 has it on every one.
    fn chunk_in_l1(&mut self, q: &Query<'_>, i: usize, hash: u128) -> Option<Vec<EntryId>> {
        if !q.shards.iter().all(|&shard| {
            let key = q.key(shard, hash);
            self.available(&key).is_some() || self.being_written(&key)
        }) {
            return None;
        }
        let mut ids = Vec::with_capacity(q.shards.len());
        for &shard in q.shards {
            let key = q.key(shard, hash);
            let parent = i.checked_sub(1).map(|p| q.key(shard, q.hashes[p]));
            ids.push(
                self.available(&key)
                    .or_else(|| self.take_back(&key, parent))?,
            );
        }
        Some(ids)
    }

    /// The last of `q`'s hashes ready on every shard: its position and its entry per shard.
    fn last_hit(&self, q: &Query<'_>) -> Option<(usize, Vec<EntryId>)> {
        if q.shards.is_empty() {
            return None;
        }
        q.hashes.iter().enumerate().rev().find_map(|(i, &hash)| {
            let ids: Option<Vec<EntryId>> = q
                .shards
                .iter()
                .map(|&shard| self.ready(&q.key(shard, hash)))
                .collect();
            ids.map(|ids| (i, ids))
        })
    }

    /// What a lookup teaches about parents: each hit chunk in L1 without a known parent gets
    /// the one before it (where that is in L1 too), and each chunk not found is remembered with
    /// its parent for a store that may start there (and as asked for).
    fn learn_parents(
        &mut self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
        hit: &[Vec<Option<EntryId>>],
    ) {
        let found = hit.first().map_or(0, Vec::len);
        for (&shard, per_shard) in shards.iter().zip(hit) {
            for i in 1..found {
                let (Some(id), Some(parent)) = (per_shard[i], per_shard[i - 1]) else {
                    continue;
                };
                if !self.tree.has_parent_key(id) {
                    let parent_key = Key {
                        fingerprint,
                        salt,
                        shard,
                        hash: hashes[i - 1],
                    };
                    let (entries, policies) = (&self.entries, &mut self.policies);
                    self.tree.link(id, parent_key, parent, &mut |n, leaf| {
                        set_leaf(entries, policies, n, leaf)
                    });
                }
            }
        }
        let cap = self.entries.len().max(hints::MIN_HINTS);
        for i in found..hashes.len() {
            let parent = i.checked_sub(1).map(|p| hashes[p]);
            self.hints
                .remember(fingerprint, salt, hashes[i], parent, cap);
        }
    }

    /// Pins the prefix of `hashes` that is ready on every shard, touching nothing, and returns
    /// its length and the pinned entries: what a lower tier's fill keeps while it takes pages
    /// for the rest, so that its own evictions cannot take the head of the very prefix it
    /// extends. When the whole of `hashes` is ready nothing is filled and nothing is pinned.
    /// Unpin with [`Cache::unpin_prefix`].
    pub fn pin_ready_prefix(
        &mut self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
    ) -> (u32, Vec<EntryId>) {
        let found = self.ready_prefix(fingerprint, salt, shards, hashes);
        if found as usize == hashes.len() {
            return (found, Vec::new());
        }
        let mut ids = Vec::with_capacity(found as usize * shards.len());
        for &hash in &hashes[..found as usize] {
            for &shard in shards {
                let key = Key {
                    fingerprint,
                    salt,
                    shard,
                    hash,
                };
                let id = self.ready(&key).expect("in the ready prefix");
                self.pin(id);
                ids.push(id);
            }
        }
        (found, ids)
    }

    /// Ends [`Cache::pin_ready_prefix`]'s pins.
    pub fn unpin_prefix(&mut self, ids: &[EntryId]) {
        for &id in ids {
            self.unpin(id);
        }
    }

    /// Length of the prefix of `hashes` that is ready on every shard, touching nothing.
    pub fn ready_prefix(
        &self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
    ) -> u32 {
        self.prefix_where(fingerprint, salt, shards, hashes, |c, k| {
            c.ready(k).is_some()
        })
    }

    /// Length of the prefix of `hashes` that a lookup would report (ready on every shard, being
    /// read back from disk, or being written to it: taken back), touching nothing: what the
    /// tiers below need not fetch.
    pub fn available_prefix(
        &self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
    ) -> u32 {
        self.prefix_where(fingerprint, salt, shards, hashes, |c, k| {
            c.available(k).is_some() || c.being_written(k)
        })
    }

    fn prefix_where(
        &self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
        found: fn(&Cache, &Key) -> bool,
    ) -> u32 {
        if shards.is_empty() {
            return 0;
        }
        hashes
            .iter()
            .take_while(|&&hash| {
                shards.iter().all(|&shard| {
                    found(
                        self,
                        &Key {
                            fingerprint,
                            salt,
                            shard,
                            hash,
                        },
                    )
                })
            })
            .count() as u32
    }
}
