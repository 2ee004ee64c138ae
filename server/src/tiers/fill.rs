//! What the tiers below L1 share when a lookup asks them to fill L1: which chunks L1 lacks of
//! the lookup's prefix, where their pages go, and the head of the prefix kept pinned meanwhile.

use std::sync::Arc;

use crate::l1::evict::EntryId;
use crate::l1::pool::ClassId;
use crate::l1::L1;
use crate::wire::Lookup;

/// The head of a lookup's prefix that L1 holds, pinned while the tiers below fill the rest:
/// a fill's pages come from evictions, and those must not take the head of the very prefix the
/// fill extends (it was stored long enough ago to be the next victim, and without it the
/// lookup reports nothing). Unpinned on drop, after the lookup has pinned what it reports.
#[derive(Debug)]
pub struct PrefixPin {
    l1: Arc<L1>,
    chunks: usize,
    ids: Vec<EntryId>,
}

impl PrefixPin {
    /// Pins nothing yet.
    pub fn new(l1: &Arc<L1>) -> PrefixPin {
        PrefixPin {
            l1: l1.clone(),
            chunks: 0,
            ids: Vec::new(),
        }
    }

    /// Pins the chunks of `l`'s prefix that became ready in L1 beyond those already pinned
    /// (none when L1 holds the whole prefix: then nothing is filled).
    pub fn extend(&mut self, l: &Lookup) {
        let rest = &l.hashes[self.chunks.min(l.hashes.len())..];
        let (n, ids) = self
            .l1
            .cache()
            .pin_ready_prefix(l.fingerprint, l.salt, &l.shards, rest);
        self.chunks += n as usize;
        self.ids.extend(ids);
    }
}

impl Drop for PrefixPin {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.l1.cache().unpin_prefix(&self.ids);
        }
    }
}

/// A shard of a lookup, and the page class and layout digest its registration gives it.
pub type ShardPages = (u32, (ClassId, u64));

/// Where a fingerprint's shards take pages in L1: only a registered cache says what size its
/// chunks are. The control plane answers from its sessions.
pub trait Registrations: Send + Sync {
    /// Each of `shards`' page class and layout digest, from some registration of `fingerprint`
    /// and that shard; `None` when a shard has none.
    fn pages(&self, fingerprint: u64, shards: &[u32]) -> Option<Vec<ShardPages>>;
}

/// What a tier below L1 may fill for lookup `l`: the chunks L1 already holds of its prefix (or
/// is reading back from disk), and each shard's page class and size (only a registered cache
/// says what size they are); None when L1 holds the whole prefix or a shard has no
/// registration.
pub(crate) fn missing_prefix(
    l1: &L1,
    regs: &dyn Registrations,
    l: &Lookup,
) -> Option<(usize, Vec<ShardPages>)> {
    let have = l1
        .cache()
        .available_prefix(l.fingerprint, l.salt, &l.shards, &l.hashes) as usize;
    if have == l.hashes.len() {
        return None;
    }
    Some((have, regs.pages(l.fingerprint, &l.shards)?))
}
