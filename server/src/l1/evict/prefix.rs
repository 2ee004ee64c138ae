//! Prefix-aware LRU: evicts leaves of the prefix tree first (a chunk none of whose successors
//! is held), least recently used first; a chunk with successors held goes only when no leaf can
//! (every leaf pinned). A lookup stops at the first chunk not held, so taking a prefix's head
//! leaves the rest stored but unreachable, while taking its tail costs one chunk of hit. A
//! conversation idle longest loses its tail first, then the chunk before it (which becomes a
//! leaf with the conversation's old stamp), so whole idle conversations go tail to head before
//! an active one loses anything; a head shared by many conversations (a system prompt) stays
//! while any of them is held. Victim choice is O(log n): two ordered sets keyed by last use.

use std::collections::BTreeSet;

use super::{EntryId, EvictionPolicy};

#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    /// The policy's clock when the entry was last stored, read or unpinned.
    stamp: u64,
    /// No successor held (as the cache last said; an entry starts as a leaf).
    leaf: bool,
    /// In one of the sets (evictable).
    queued: bool,
}

/// See the module header.
#[derive(Debug, Default)]
pub(super) struct PrefixLru {
    clock: u64,
    meta: Vec<Meta>,
    leaves: BTreeSet<(u64, EntryId)>,
    inner: BTreeSet<(u64, EntryId)>,
}

impl PrefixLru {
    fn meta_mut(&mut self, id: EntryId) -> &mut Meta {
        let i = id as usize;
        if self.meta.len() <= i {
            self.meta.resize(
                i + 1,
                Meta {
                    leaf: true,
                    ..Meta::default()
                },
            );
        }
        &mut self.meta[i]
    }

    fn set_of(&mut self, leaf: bool) -> &mut BTreeSet<(u64, EntryId)> {
        if leaf {
            &mut self.leaves
        } else {
            &mut self.inner
        }
    }

    fn dequeue(&mut self, id: EntryId) -> bool {
        let Some(&m) = self.meta.get(id as usize) else {
            return false;
        };
        if !m.queued {
            return false;
        }
        self.set_of(m.leaf).remove(&(m.stamp, id));
        self.meta[id as usize].queued = false;
        true
    }

    fn enqueue(&mut self, id: EntryId) {
        self.clock += 1;
        let stamp = self.clock;
        let m = self.meta_mut(id);
        m.stamp = stamp;
        m.queued = true;
        let leaf = m.leaf;
        self.set_of(leaf).insert((stamp, id));
    }
}

impl EvictionPolicy for PrefixLru {
    fn insert(&mut self, id: EntryId) {
        if !self.meta_mut(id).queued {
            self.enqueue(id);
        }
    }

    fn touch(&mut self, id: EntryId) {
        if self.dequeue(id) {
            self.enqueue(id);
        }
    }

    fn remove(&mut self, id: EntryId) {
        self.dequeue(id);
    }

    fn created(&mut self, id: EntryId, _key: u64) {
        self.dequeue(id);
        *self.meta_mut(id) = Meta {
            leaf: true,
            ..Meta::default()
        };
    }

    fn set_leaf(&mut self, id: EntryId, leaf: bool) {
        let m = *self.meta_mut(id);
        if m.leaf == leaf {
            return;
        }
        if m.queued {
            self.set_of(m.leaf).remove(&(m.stamp, id));
            self.set_of(leaf).insert((m.stamp, id));
        }
        self.meta[id as usize].leaf = leaf;
    }

    fn peek_victim(&self) -> Option<EntryId> {
        self.leaves
            .first()
            .or_else(|| self.inner.first())
            .map(|&(_, id)| id)
    }

    fn len(&self) -> usize {
        self.leaves.len() + self.inner.len()
    }
}
