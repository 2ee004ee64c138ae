//! Lookups: the longest prefix of a token sequence stored on every shard, what a lookup teaches
//! the prefix tree about parents (and the hints it leaves for a store that starts where the hit
//! ended), and the touch-free prefixes the lower tiers ask for before they fetch.

use tokio::time::{Duration, Instant};

use super::{hints, set_leaf, Cache, Key, SessionId};
use crate::l1::evict::EntryId;

impl Cache {
    /// Longest prefix of `hashes` stored on every shard (ready, or being read back from disk:
    /// a retrieve waits for those); pins it when `pin` is set and the hit is not empty.
    /// Returns the hit and the pin id (0 for none).
    #[allow(clippy::too_many_arguments)]
    pub fn lookup(
        &mut self,
        owner: SessionId,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
        pin: bool,
        readers: u16,
        now: Instant,
        ttl: Duration,
    ) -> (u32, u64) {
        let mut hit: Vec<Vec<EntryId>> = vec![Vec::new(); shards.len()];
        'chunks: for &hash in hashes {
            let mut ids = Vec::with_capacity(shards.len());
            for &shard in shards {
                match self.available(&Key {
                    fingerprint,
                    salt,
                    shard,
                    hash,
                }) {
                    Some(id) => ids.push(id),
                    None => break 'chunks,
                }
            }
            for (per_shard, id) in hit.iter_mut().zip(ids) {
                per_shard.push(id);
            }
        }
        let found = hit.first().map_or(0, Vec::len);
        self.learn_parents(fingerprint, salt, shards, hashes, &hit);
        if shards.is_empty() || found == 0 {
            return (0, 0);
        }
        for per_shard in &hit {
            for &id in per_shard {
                self.touch(id);
            }
        }
        if !pin {
            return (found as u32, 0);
        }
        // Pin the head of the hit that fits in the lookup pins' share; the rest is reported
        // but unpinned, so stores may evict it (its retrieve then finds it missing and vLLM
        // recomputes from there, as it would have had the hit been reported shorter). It is
        // held meanwhile: evicted only when nothing else can be (`holds`).
        let room = self.lookup_pin_room(hit[0][0]) as usize / shards.len();
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
            return (found as u32, 0);
        }
        let pin_id = self.pin_lookup(owner, shards, hit, readers, now, ttl);
        (found as u32, pin_id)
    }

    /// What a lookup teaches about parents: each hit chunk without a known parent gets the one
    /// before it, and each chunk not found is remembered with its parent for a store that may
    /// start there (and as asked for).
    fn learn_parents(
        &mut self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
        hit: &[Vec<EntryId>],
    ) {
        let found = hit.first().map_or(0, Vec::len);
        for (&shard, per_shard) in shards.iter().zip(hit) {
            for i in 1..found {
                let id = per_shard[i];
                if !self.tree.has_parent_key(id) {
                    let parent_key = Key {
                        fingerprint,
                        salt,
                        shard,
                        hash: hashes[i - 1],
                    };
                    let (entries, policies) = (&self.entries, &mut self.policies);
                    self.tree
                        .link(id, parent_key, per_shard[i - 1], &mut |n, leaf| {
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
        self.prefix_where(fingerprint, salt, shards, hashes, Cache::ready)
    }

    /// Length of the prefix of `hashes` that a lookup would report (ready on every shard, or
    /// being read back from disk), touching nothing: what the tiers below need not fetch.
    pub fn available_prefix(
        &self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
    ) -> u32 {
        self.prefix_where(fingerprint, salt, shards, hashes, Cache::available)
    }

    fn prefix_where(
        &self,
        fingerprint: u64,
        salt: u64,
        shards: &[u32],
        hashes: &[u128],
        found: fn(&Cache, &Key) -> Option<EntryId>,
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
                    .is_some()
                })
            })
            .count() as u32
    }
}
