//! Parents learnt from lookups, for the first chunk of a store. A store names its chunks in
//! order, so each chunk's parent is the one before it, except the first: vLLM's connector
//! stores only the chunks computed since its last store (or since the lookup's hit), so the
//! first chunk's parent was named only by the lookup that came before, which lists the whole
//! prompt in order. A lookup remembers the parent of each chunk it did not find (those are the
//! ones a store may begin with) in a bounded FIFO table: a hint older than the table's size is
//! forgotten and the chunk is stored as a root (reachable, but its prefix tree starts there).
//! The same table says whether a chunk was asked for at all before it was stored (the first
//! chunk of a lookup that found nothing is remembered with no parent), which `prefix-reuse`
//! uses to tell a client that reads by lookup from one that stores and retrieves by key.

use std::collections::{HashMap, VecDeque};

use super::Key;

/// Most hints kept when the pool is small.
pub(super) const MIN_HINTS: usize = 1 << 16;

/// Bounded map from a chunk (fingerprint, salt, hash) to its parent's hash (none for the
/// first chunk of a prompt).
#[derive(Debug, Default)]
pub(super) struct Hints {
    parent: HashMap<u64, Option<u128>>,
    order: VecDeque<u64>,
}

fn slot(fingerprint: u64, salt: u64, hash: u128) -> u64 {
    Key {
        fingerprint,
        salt,
        shard: 0,
        hash,
    }
    .digest()
}

impl Hints {
    /// Remembers that a lookup asked for `hash` and that its parent is `parent`, keeping at
    /// most `cap` hints.
    pub(super) fn remember(
        &mut self,
        fingerprint: u64,
        salt: u64,
        hash: u128,
        parent: Option<u128>,
        cap: usize,
    ) {
        let s = slot(fingerprint, salt, hash);
        if self.parent.insert(s, parent).is_none() {
            self.order.push_back(s);
        }
        while self.order.len() > cap.max(1) {
            if let Some(old) = self.order.pop_front() {
                self.parent.remove(&old);
            }
        }
    }

    /// The parent hash of `key`'s chunk, if a lookup named it.
    pub(super) fn parent_of(&self, key: &Key) -> Option<u128> {
        self.parent
            .get(&slot(key.fingerprint, key.salt, key.hash))
            .copied()
            .flatten()
    }

    /// Whether a lookup asked for `key`'s chunk (and did not find it) within the last `cap`
    /// hints.
    pub(super) fn asked(&self, key: &Key) -> bool {
        self.parent
            .contains_key(&slot(key.fingerprint, key.salt, key.hash))
    }

    /// Hints held.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.parent.len()
    }
}
