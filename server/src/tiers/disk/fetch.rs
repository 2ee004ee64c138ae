//! A lookup's trip to the disk: find in the index the prefix of what L1 lacks, take fresh L1
//! pages for it (`Filling`: safe from eviction, reported by lookups, waited for by retrieves),
//! and have the read thread read all of it at once, check each value and copy it into its page.
//! The lookup does not wait: it answers with the chunks being filled counted and pinned, and
//! vLLM's asynchronous load overlaps the read ([`super::DiskTier::wait_for_fills`]).

use std::sync::Arc;

use super::io::{ReadItem, ReadJob};
use super::DiskTier;
use crate::l1::cache::{Key, StorePlan};
use crate::l1::L1;
use crate::tiers::fill::{missing_prefix, Registrations};
use crate::wire::Lookup;

/// Starts bringing into L1 what the disk holds of `l`'s chunks beyond L1's prefix: when it
/// returns they are `Filling` entries that the lookup reports. `l` keeps within the request
/// limits: dispatch refused it otherwise.
pub fn start_fill(l1: &L1, regs: &dyn Registrations, disk: &Arc<DiskTier>, l: &Lookup) {
    if l.shards.is_empty() || l.hashes.is_empty() || l1.memory().is_none() {
        return;
    }
    let Some((have, found)) = missing_prefix(l1, regs, l) else {
        return;
    };
    let placements: Vec<(u32, crate::l1::pool::ClassId, u64, u64)> = {
        let cache = l1.cache();
        found
            .into_iter()
            .map(|(shard, (class, digest))| (shard, class, cache.page_bytes(class), digest))
            .collect()
    };
    let shards = placements.len();
    let chunk_bytes: u64 = placements.iter().map(|p| p.2).sum::<u64>().max(1);
    let most = (disk.config.fetch_max_bytes / chunk_bytes).max(1) as usize;
    let wanted = &l.hashes[have..l.hashes.len().min(have + most)];
    let key = |hash: u128, shard: u32| Key {
        fingerprint: l.fingerprint,
        salt: l.salt,
        shard,
        hash,
    };

    // The prefix of chunks the disk holds on every shard.
    let locs: Vec<Vec<(Key, super::index::Loc, u64, u64)>> = {
        let ix = disk.index.lock();
        let mut out = Vec::new();
        'chunks: for &hash in wanted {
            let mut per = Vec::with_capacity(shards);
            for p in &placements {
                let k = key(hash, p.0);
                match ix.get(&k) {
                    Some(loc) => per.push((k, loc, ix.offset(&loc), ix.read_len(&loc))),
                    None => break 'chunks,
                }
            }
            out.push(per);
        }
        out
    };
    let m = &disk.metrics;
    let present = locs.len();
    if present == 0 {
        m.lookup_chunks
            .with_label_values(&["miss"])
            .inc_by(wanted.len() as u64);
        return;
    }

    // Pages for them, shard by shard; chunks L1 already has (another lookup's fill, a store)
    // are left alone. Only as many as the drives read before the deadline, given what is
    // queued already; when nothing is, at least one chunk (and the rate is measured anew).
    let mut items = Vec::new();
    let mut take = 0;
    let mut usable;
    {
        let mut cache = l1.cache();
        let mut room = disk.read_room();
        let idle = disk.reads_idle();
        for per in &locs {
            let cost: u64 = per
                .iter()
                .filter(|(k, ..)| !cache.contains(k))
                .map(|(.., len)| len)
                .sum();
            if cost > room && !(idle && take == 0) {
                break;
            }
            room = room.saturating_sub(cost);
            take += 1;
        }
        if take < present {
            m.fill_chunks
                .with_label_values(&["busy"])
                .inc_by((present - take) as u64);
        }
        usable = take;
        let locs = &locs[..take];
        let plans: Vec<Vec<StorePlan>> = placements
            .iter()
            .enumerate()
            .map(|(s, p)| {
                let keys: Vec<Key> = locs.iter().map(|per| per[s].0).collect();
                cache.begin_fill(p.1, &keys)
            })
            .collect();
        for (c, per) in locs.iter().enumerate() {
            for (s, p) in placements.iter().enumerate() {
                let (k, loc, offset, len) = per[s];
                match plans[s][c] {
                    StorePlan::Write {
                        entry,
                        offset: page_offset,
                    } => items.push(ReadItem {
                        chunk: c,
                        key: k,
                        loc,
                        offset,
                        len,
                        entry,
                        page_offset,
                        page_bytes: p.2,
                        digest: p.3,
                    }),
                    StorePlan::Present => m.fill_chunks.with_label_values(&["present"]).inc(),
                    StorePlan::Refused | StorePlan::Skipped => usable = usable.min(c),
                }
            }
        }
        // Pages past a refused chunk could never be part of a hit.
        let dropped: Vec<_> = items
            .iter()
            .filter(|it| it.chunk >= usable)
            .map(|it| it.entry)
            .collect();
        if !dropped.is_empty() {
            cache.finish_store(&dropped, false);
        }
    }
    items.retain(|it| it.chunk < usable);
    if take > usable {
        m.fill_chunks
            .with_label_values(&["no_free_page"])
            .inc_by((take - usable) as u64);
    }
    if items.is_empty() {
        // Everything usable is in L1 already (or nothing fits).
        let hit = usable as u64;
        m.lookup_chunks.with_label_values(&["hit"]).inc_by(hit);
        m.lookup_chunks
            .with_label_values(&["miss"])
            .inc_by(wanted.len() as u64 - hit);
        return;
    }

    let job = ReadJob {
        items,
        chunks: usable,
        wanted: wanted.len(),
        sent: std::time::Instant::now(),
    };
    disk.reads_queued(job.bytes());
    if let Err(job) = disk.submit_read(job) {
        // The read thread is gone or backed up: give the pages back.
        disk.reads_done(job.bytes(), None);
        let ids: Vec<_> = job.items.iter().map(|it| it.entry).collect();
        l1.cache().finish_store(&ids, false);
        m.lookup_chunks
            .with_label_values(&["miss"])
            .inc_by(wanted.len() as u64);
    }
}
