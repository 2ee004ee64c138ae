//! A lookup's trip to the disk: find in the index the prefix of what L1 lacks, take fresh L1
//! pages for it (`Filling`: safe from eviction, reported by lookups, waited for by retrieves),
//! and have the read thread read all of it at once, check each value and copy it into its page.
//! The lookup does not wait: it answers with the chunks being filled counted and pinned, and
//! vLLM's asynchronous load overlaps the read ([`super::DiskTier::wait_for_fills`]). The
//! pages are taken as the L2's are ([`take_pages`]), but `Filling` and only where one is free.

use super::index::Loc;
use super::io::{ReadItem, ReadJob};
use super::DiskTier;
use crate::l1::cache::Key;
use crate::l1::L1;
use crate::tiers::fill::{kept_prefix, take_pages, Registrations, Wanted};
use crate::wire::Lookup;

/// Where a found chunk is on disk: its place, byte offset and read length.
type OnDisk = (Loc, u64, u64);

/// Starts bringing into L1 what the disk holds of `l`'s chunks beyond L1's prefix and beyond
/// those its client holds ([`Lookup::held`]): when it returns they are `Filling` entries that
/// the lookup reports. `l` keeps within the request limits: dispatch refused it otherwise.
///
/// The chunks the client holds are not read: vLLM loads none of them, and each read would
/// take an L1 page and evict a chunk only L1 holds for a chunk the disk keeps anyway. (Until
/// session 27 they were read like the rest: on the agentic replay, with L1 at a quarter of
/// the chunks, they took the read budget and reads past it were left `busy`.) They count
/// towards the hit where the disk holds them (`held_below` in the lookup's handler); where
/// one is kept neither here nor in L1 the hit ends there, and nothing is read.
pub fn start(l1: &L1, regs: &dyn Registrations, disk: &DiskTier, l: &Lookup) {
    let Some(wanted) = Wanted::new(l1, regs, l, disk.config.fetch_max_bytes, |held| held.len())
    else {
        return;
    };
    let shards = wanted.placements.len();
    if !wanted.skipped.is_empty() {
        let on_disk = [disk.holds_chunks(l, wanted.skipped)];
        disk.metrics
            .fill_chunks
            .with_label_values(&["client_holds"])
            .inc_by(on_disk[0].iter().filter(|&&on| on).count() as u64);
        if kept_prefix(l1, l, wanted.skipped, &on_disk) < wanted.skipped.len() {
            return;
        }
    }

    // The prefix of chunks the disk holds on every shard.
    let locs: Vec<Vec<(Key, OnDisk)>> = {
        let ix = disk.index.lock();
        let mut out = Vec::new();
        'chunks: for &hash in wanted.hashes {
            let mut per = Vec::with_capacity(shards);
            for p in &wanted.placements {
                let k = wanted.key(hash, p.shard);
                match ix.get(&k) {
                    Some(loc) => per.push((k, (loc, ix.offset(&loc), ix.read_len(&loc)))),
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
            .inc_by(wanted.hashes.len() as u64);
        return;
    }

    // Only as many as the drives read before the deadline, given what is queued already; when
    // nothing is, at least one chunk (and the rate is measured anew).
    let (items, take, usable) = {
        let mut cache = l1.cache();
        let mut room = disk.read_room();
        let idle = disk.reads_idle();
        let mut take = 0;
        for per in &locs {
            let cost: u64 = per
                .iter()
                .filter(|(k, _)| !cache.contains(k))
                .map(|(_, (.., len))| len)
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
        let mut locs = locs;
        locs.truncate(take);
        let (pages, usable) = take_pages(
            &mut cache,
            &wanted,
            locs,
            true,
            &m.fill_chunks.with_label_values(&["present"]),
        );
        // Pages past a refused chunk could never be part of a hit.
        let dropped: Vec<_> = pages
            .iter()
            .filter(|p| p.chunk >= usable)
            .map(|p| p.entry)
            .collect();
        if !dropped.is_empty() {
            cache.finish_store(&dropped, false);
        }
        let items: Vec<ReadItem> = pages
            .into_iter()
            .filter(|p| p.chunk < usable)
            .map(|p| {
                let (loc, offset, len) = p.found;
                ReadItem {
                    chunk: p.chunk,
                    key: p.key,
                    loc,
                    offset,
                    len,
                    entry: p.entry,
                    page_offset: p.offset,
                    page_bytes: p.placement.page_bytes,
                    digest: p.placement.digest,
                }
            })
            .collect();
        (items, take, usable)
    };
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
            .inc_by(wanted.hashes.len() as u64 - hit);
        return;
    }

    let job = ReadJob {
        items,
        chunks: usable,
        wanted: wanted.hashes.len(),
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
            .inc_by(wanted.hashes.len() as u64);
    }
}
