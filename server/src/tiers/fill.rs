//! What a tier below L1 is, and the fill every one of them runs when a lookup asks it for the
//! part of a prefix that L1 lacks: [`Wanted`] says which chunks and where each shard's pages
//! go, the tier finds which of them it holds (the disk in its index, L2 in one round trip),
//! [`take_pages`] takes L1 pages for that prefix, and the tier writes its values into them
//! (the disk's read thread, L2's blocking thread) and settles the entries. Meanwhile
//! [`PrefixPin`] keeps L1's own head of the prefix from being evicted by the fill's pages.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use prometheus::IntCounter;

use crate::l1::cache::{Cache, Key, StorePlan};
use crate::l1::evict::EntryId;
use crate::l1::pool::ClassId;
use crate::l1::L1;
use crate::wire::Lookup;

/// A tier below L1, as the chain sees it: it answers for what it holds.
pub trait Tier: Send + Sync + std::fmt::Debug + 'static {
    /// Brings into L1 what this tier holds of lookup `l`'s prefix beyond what L1 holds or is
    /// already filling. `above` are the tiers nearer L1, asked before this one. `l` keeps
    /// within the request limits.
    fn fill(
        self: Arc<Self>,
        l1: &Arc<L1>,
        regs: &Arc<dyn Registrations>,
        l: &Arc<Lookup>,
        above: &[Arc<dyn Tier>],
    ) -> Fill;

    /// Which of `hashes`, chunks of lookup `l`, this tier holds on every shard `l` names, from
    /// what it knows without a round trip (the disk's index); empty where it cannot say.
    fn holds(&self, _l: &Lookup, _hashes: &[u128]) -> Vec<bool> {
        Vec::new()
    }

    /// Whether a lookup answers before this tier's fill is done: its chunks are `Filling`
    /// (counted and pinned as hits) and a retrieve waits for them ([`Tier::settle`]).
    fn answers_early(&self) -> bool {
        false
    }

    /// Waits until none of `keys` is being filled by this tier, for at most its deadline.
    fn settle<'a>(&'a self, _l1: &'a L1, _keys: &'a [Key]) -> BoxFuture<'a, ()> {
        Box::pin(async {})
    }

    /// Chunks whose copy into L1 has just completed, all of one layout (`digest`): a tier
    /// that takes what is stored takes them here. (The disk takes L1's victims instead.)
    fn stored(&self, _keys: &[Key], _digest: u64) {}
}

/// When a lookup that asked a tier may answer.
pub enum Fill {
    /// Now: the fill is done, or started and its chunks count as hits already.
    Now,
    /// Once this is done: the fill puts its chunks into L1 before the lookup reports them.
    Later(BoxFuture<'static, ()>),
}

impl std::fmt::Debug for Fill {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Fill::Now => "Fill::Now",
            Fill::Later(_) => "Fill::Later",
        })
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

/// Where one shard's chunks go in L1.
#[derive(Debug, Clone, Copy)]
pub struct Placement {
    /// The shard.
    pub shard: u32,
    /// Its page class.
    pub class: ClassId,
    /// That class's page size.
    pub page_bytes: u64,
    /// Its registration's layout digest (values carry it).
    pub digest: u64,
}

/// What a tier is asked to fill for one lookup: the chunks of its prefix after those L1 holds
/// or is filling (and, for a tier that skips them, those the client holds), at most a tier's
/// byte budget of them, and where each shard's pages go.
#[derive(Debug)]
pub struct Wanted<'l> {
    /// The lookup.
    pub lookup: &'l Lookup,
    /// Chunks after L1's prefix that the client holds ([`Lookup::held`]) and the tier passes
    /// over: not filled, but the hit reaches `hashes` only where each of them is kept, in L1 or
    /// below. Between them and `hashes` may be chunks L1 holds or is filling.
    pub skipped: &'l [u128],
    /// The wanted chunks' hashes, in prompt order.
    pub hashes: &'l [u128],
    /// One per shard of the lookup, in its order.
    pub placements: Vec<Placement>,
}

impl<'l> Wanted<'l> {
    /// What L1 lacks of `l`'s prefix, at most `max_bytes` of it (at least one chunk), past the
    /// chunks the client holds that `skip` passes over: it is given the held chunks from the
    /// first one L1 lacks (later ones L1 may hold), in order, and says how many leading ones
    /// not to fill. `None` when L1 holds or is filling all of that, its pool is not ready yet,
    /// or a shard has no registration.
    pub fn new(
        l1: &L1,
        regs: &dyn Registrations,
        l: &'l Lookup,
        max_bytes: u64,
        skip: impl FnOnce(&[u128]) -> usize,
    ) -> Option<Wanted<'l>> {
        if l.shards.is_empty() || l.hashes.is_empty() || l1.memory().is_none() {
            return None;
        }
        let available = |from: usize| {
            l1.cache()
                .available_prefix(l.fingerprint, l.salt, &l.shards, &l.hashes[from..])
                as usize
        };
        let have = available(0);
        let held = (l.held as usize).clamp(have, l.hashes.len());
        let skipped = have + skip(&l.hashes[have..held]).min(held - have);
        // Past the chunks passed over, those L1 holds or is filling already (a tier above
        // filling them) are not wanted either.
        let from = match skipped {
            s if s > have && s < l.hashes.len() => s + available(s),
            s => s,
        };
        if from >= l.hashes.len() {
            return None;
        }
        let found = regs.pages(l.fingerprint, &l.shards)?;
        let placements: Vec<Placement> = {
            let cache = l1.cache();
            found
                .into_iter()
                .map(|(shard, (class, digest))| Placement {
                    shard,
                    class,
                    page_bytes: cache.page_bytes(class),
                    digest,
                })
                .collect()
        };
        let chunk_bytes: u64 = placements.iter().map(|p| p.page_bytes).sum::<u64>().max(1);
        let most = (max_bytes / chunk_bytes).max(1) as usize;
        Some(Wanted {
            lookup: l,
            skipped: &l.hashes[have..skipped],
            hashes: &l.hashes[from..l.hashes.len().min(from + most)],
            placements,
        })
    }

    /// The key of `hash` on `shard`.
    pub fn key(&self, hash: u128, shard: u32) -> Key {
        Key {
            fingerprint: self.lookup.fingerprint,
            salt: self.lookup.salt,
            shard,
            hash,
        }
    }
}

/// How many leading `held` (chunks of `l` its client holds) are kept where the lookup counts
/// them: by a tier, `by_tiers[t][i]` saying whether tier `t` holds `held[i]`, or available in L1
/// on every shard.
pub fn kept_prefix(l1: &L1, l: &Lookup, held: &[u128], by_tiers: &[Vec<bool>]) -> usize {
    let cache = l1.cache();
    held.iter()
        .enumerate()
        .take_while(|&(i, hash)| {
            by_tiers.iter().any(|t| t.get(i) == Some(&true))
                || cache.available_prefix(
                    l.fingerprint,
                    l.salt,
                    &l.shards,
                    std::slice::from_ref(hash),
                ) == 1
        })
        .count()
}

/// One L1 page taken for a chunk a tier holds.
#[derive(Debug)]
pub struct Page<T> {
    /// Which wanted chunk it belongs to.
    pub chunk: usize,
    /// The chunk's key on its shard.
    pub key: Key,
    /// Its new entry, `Writing` or `Filling` until [`Cache::finish_store`].
    pub entry: EntryId,
    /// The page's byte offset in the pool.
    pub offset: u64,
    /// Where its shard's chunks go.
    pub placement: Placement,
    /// What the tier found for it (a value, a place on disk).
    pub found: T,
}

/// Takes L1 pages for what a tier found: `found[c][s]` for wanted chunk `c` on shard `s`, the
/// prefix it holds on every shard. With `filling` the entries are `Filling` (a lookup reports
/// them at once and a retrieve waits for them; only free pages are taken), else `Writing`
/// (invisible until settled). Pages are taken shard by shard; chunks L1 already has (another
/// lookup's fill, a store) are left alone and counted in `present`. Returns the pages, by chunk
/// then shard, and how many chunks are usable: none from the first one a page was refused for,
/// since a chunk after a gap can never be part of a hit. The caller settles every page.
pub fn take_pages<T>(
    cache: &mut Cache,
    wanted: &Wanted<'_>,
    found: Vec<Vec<(Key, T)>>,
    filling: bool,
    present: &IntCounter,
) -> (Vec<Page<T>>, usize) {
    let plans: Vec<Vec<StorePlan>> = wanted
        .placements
        .iter()
        .enumerate()
        .map(|(s, p)| {
            let keys: Vec<Key> = found.iter().map(|per| per[s].0).collect();
            if filling {
                cache.begin_fill(p.class, &keys)
            } else {
                cache.begin_store(p.class, &keys)
            }
        })
        .collect();
    let mut usable = found.len();
    let mut pages = Vec::new();
    for (c, per) in found.into_iter().enumerate() {
        for (s, (key, found)) in per.into_iter().enumerate() {
            match plans[s][c] {
                StorePlan::Write { entry, offset } => pages.push(Page {
                    chunk: c,
                    key,
                    entry,
                    offset,
                    placement: wanted.placements[s],
                    found,
                }),
                StorePlan::Present => present.inc(),
                StorePlan::Refused | StorePlan::Skipped => usable = usable.min(c),
            }
        }
    }
    (pages, usable)
}

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
