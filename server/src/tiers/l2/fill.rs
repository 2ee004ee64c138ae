//! A lookup's trip to L2: fetch what L1 lacks in one batch under the deadline, check every
//! value, and put the longest prefix held on every shard into L1 pages before the lookup
//! itself runs — so hits from L2 are reported, pinned and retrieved exactly like L1 hits.
//!
//! The pages are taken `Writing` ([`take_pages`]): invisible to lookups and safe from eviction
//! while a blocking thread checks the values and writes them; they become hits only when
//! [`Cache::finish_store`](crate::l1::cache::Cache::finish_store) runs. A value that fails its
//! check never reaches a page; its page is returned.

use std::sync::Arc;

use tokio::time::Instant;

use super::{L2Error, L2Tier};
use crate::l1::cache::Key;
use crate::l1::evict::EntryId;
use crate::l1::L1;
use crate::tiers::fill::{kept_prefix, take_pages, Registrations, Tier, Wanted};
use crate::tiers::value::Rejected;
use crate::wire::Lookup;

/// What the blocking fill did.
#[derive(Debug, Default)]
struct Filled {
    ok: Vec<EntryId>,
    failed: Vec<EntryId>,
    rejected: Vec<Rejected>,
    bytes: u64,
}

/// Brings into L1 what L2 holds of `l`'s chunks beyond L1's prefix. Returns when they are hits
/// in L1, or at once when L2 is down, slow past the deadline, or holds nothing useful.
/// `l` keeps within the request limits: dispatch refused it otherwise.
///
/// Chunks the client holds ([`Lookup::held`]) that a tier above keeps (the disk) are not
/// fetched: the client loads none of them, and the lookup counts them where they are kept.
/// One the client holds that no tier above keeps is fetched, as the hit cannot reach past it
/// otherwise.
pub async fn fill(
    l1: &Arc<L1>,
    regs: &dyn Registrations,
    tier: &Arc<L2Tier>,
    l: &Lookup,
    above: &[Arc<dyn Tier>],
) {
    if !tier.should_ask() {
        return;
    }
    // Kept where the lookup counts a held chunk: in L1, or by a tier above (the disk's index).
    // (Checked before the round trip: should the disk drop one meanwhile, its write head passing
    // it, the hit ends there, shorter than a fetch would have made it, never longer than what
    // is kept.)
    let kept_above = |held: &[u128]| {
        let by_tiers: Vec<Vec<bool>> = above.iter().map(|t| t.holds(l, held)).collect();
        kept_prefix(l1, l, held, &by_tiers)
    };
    let Some(wanted) = Wanted::new(l1, regs, l, tier.config.fetch_max_bytes, kept_above) else {
        return;
    };
    let Some(memory) = l1.memory().cloned() else {
        return;
    };
    let keys: Vec<Key> = wanted
        .hashes
        .iter()
        .flat_map(|&hash| wanted.placements.iter().map(move |p| (hash, p.shard)))
        .map(|(hash, shard)| wanted.key(hash, shard))
        .collect();

    let started = Instant::now();
    let got = match tokio::time::timeout(tier.config.deadline, tier.store.get_many(&keys)).await {
        Ok(v) => v,
        Err(_) => {
            tier.skip_for_a_while();
            tier.note_error(&L2Error::Unavailable {
                op: "get",
                message: format!(
                    "no answer within --l2-deadline-ms {}",
                    tier.config.deadline.as_millis()
                ),
            });
            tier.metrics.lookup_timeouts.inc();
            tier.metrics
                .lookup_chunks
                .with_label_values(&["miss"])
                .inc_by(wanted.hashes.len() as u64);
            tracing::debug!(
                "L2 did not answer within {} ms; the lookup answers from L1",
                tier.config.deadline.as_millis()
            );
            return;
        }
    };

    // The prefix of chunks present on every shard.
    let shards = wanted.placements.len();
    let present = got
        .chunks(shards)
        .take_while(|per_chunk| per_chunk.iter().all(|r| matches!(r, Ok(Some(_)))))
        .count();
    if got.iter().any(Result::is_ok) {
        tier.note_ok();
    } else {
        tier.skip_for_a_while();
    }
    if let Some(Err(e)) = got.iter().find(|r| r.is_err()) {
        tier.note_error(e);
    }
    if present == 0 {
        tier.metrics
            .lookup_chunks
            .with_label_values(&["miss"])
            .inc_by(wanted.hashes.len() as u64);
        return;
    }
    let mut values = got
        .into_iter()
        .take(present * shards)
        .filter_map(|r| r.ok().flatten());
    let found: Vec<Vec<(Key, Vec<u8>)>> = keys
        .chunks(shards)
        .take(present)
        .map(|per| {
            per.iter()
                .map(|&k| (k, values.next().expect("one value per chunk and shard")))
                .collect()
        })
        .collect();
    let (pages, usable) = take_pages(
        &mut l1.cache(),
        &wanted,
        found,
        false,
        &tier.metrics.fill_chunks.with_label_values(&["present"]),
    );
    let refused = pages.iter().filter(|p| p.chunk >= usable).count();
    tier.metrics
        .fill_chunks
        .with_label_values(&["refused_pool_full"])
        .inc_by(refused as u64);
    let fills: Vec<_> = pages
        .into_iter()
        .map(|p| {
            let name = tier.store.name_of(&p.key);
            (p, name)
        })
        .collect();

    // Check and write on a blocking thread; from the first bad chunk on, nothing is kept.
    let codec = tier.codec.clone();
    let filled = tokio::task::spawn_blocking(move || {
        let mut out = Filled::default();
        let mut bad_from = usable;
        for (f, name) in fills {
            let keep = f.chunk < bad_from
                && match codec.open(&f.found, f.placement.digest, &name, f.placement.page_bytes) {
                    Ok(payload) => match memory.write(f.offset, payload) {
                        Ok(()) => {
                            out.bytes += payload.len() as u64;
                            true
                        }
                        Err(e) => {
                            tracing::warn!("writing an L2 value into the pool: {e}");
                            false
                        }
                    },
                    Err(why) => {
                        out.rejected.push(why);
                        false
                    }
                };
            if keep {
                out.ok.push(f.entry);
            } else {
                bad_from = bad_from.min(f.chunk);
                out.failed.push(f.entry);
            }
        }
        (out, bad_from)
    })
    .await;
    let (filled, hit) = match filled {
        Ok(v) => v,
        Err(e) => {
            tracing::error!("the L2 fill task failed: {e}");
            return;
        }
    };
    {
        let mut cache = l1.cache();
        // A chunk after a bad one was written but can never be part of a hit: drop it too.
        cache.finish_store(&filled.ok, true);
        cache.finish_store(&filled.failed, false);
    }
    let m = &tier.metrics;
    for why in &filled.rejected {
        m.rejected.with_label_values(&[why.label()]).inc();
    }
    if !filled.rejected.is_empty() {
        tracing::warn!(
            "rejected {} L2 values ({}); they were not used",
            filled.rejected.len(),
            filled.rejected[0]
        );
    }
    m.fill_chunks
        .with_label_values(&["filled"])
        .inc_by(filled.ok.len() as u64);
    m.bytes.with_label_values(&["read"]).inc_by(filled.bytes);
    m.lookup_chunks
        .with_label_values(&["hit"])
        .inc_by(hit as u64);
    m.lookup_chunks
        .with_label_values(&["miss"])
        .inc_by((wanted.hashes.len() - hit) as u64);
    m.fetch_seconds.observe(started.elapsed().as_secs_f64());
}
