//! Replays what kvd was sent in an agentic replay (`benches/agentic.py --dump-events`) through
//! the cache alone, in the order sent, so that eviction and pin rules can be compared on the
//! very same traffic in seconds instead of a replay's minutes:
//!
//!     cargo run --release --example replay_events -- EVENTS.txt [POLICY] [LOOKUP_PIN_PCT]
//!
//! Stores finish at once and lookups are answered in order, so the hit count differs a little
//! from the live run's (printed beside it for that reason). A pin the live kvd did not give
//! (its lookup was over the pin share there) has no retrieve or release in the file; it is
//! released after the live run's mean pin lifetime, in events.
//!
//! `REPLAY_DEMOTE=N` adds the disk tier's side of L1: victims the policy expects to be read
//! again go to the disk tier with their pages, each page free again N events after it was
//! handed over, within a reserve of `REPLAY_MARGIN` pages (default an eighth of the pool;
//! `MIN-MAX` paces it to the drive between the two, as kvd does by default). Only
//! `REPLAY_WRITE_RATE=R` makes the drive a queue instead: at most R writes (a fraction
//! accumulates) finish per event, oldest first, none before its lag. Only
//! L1's hits are counted, unless `REPLAY_DISK=1` adds the disk: every chunk written is on it
//! for good (a drive larger than the traffic), and a lookup's prefix goes on past L1's part
//! through the chunks on disk, filled into L1 at once (`begin_fill`, evicting as a fill does);
//! its hits are counted apart. A chunk stored again while the disk holds it, or whose write
//! finished while L1 held it, is known to be on disk and leaves L1 without a write, as in kvd;
//! `REPLAY_RESTORE_WRITES=1` hands it to the drive again (kvd before session 18).

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};

use anyhow::{bail, Context, Result};
use kvd_server::l1::cache::{Cache, Key, Query, StorePlan};
use kvd_server::l1::evict::{EntryId, PolicyKind};
use kvd_server::l1::pool::PagePool;
use tokio::time::{Duration, Instant};

const PAGE_BYTES: u64 = 1024;

enum Event {
    Lookup {
        pin: u64,
        hit: u32,
        chunks: Vec<u128>,
    },
    Store(Vec<u128>),
    Retrieve {
        pin: u64,
        chunks: Vec<u128>,
    },
    Release(u64),
}

fn key(hash: u128) -> Key {
    Key {
        fingerprint: 1,
        salt: 0,
        shard: 0,
        hash,
    }
}

fn parse(path: &str) -> Result<(u64, Vec<Event>)> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {path}"))?;
    let mut pages = 0;
    let mut events = Vec::new();
    for line in BufReader::new(file).lines() {
        let line = line?;
        let mut f = line.split_ascii_whitespace();
        let kind = f.next().unwrap_or("");
        if kind == "S" {
            f.next(); // the live run's outcomes
        }
        let mut nums = f.map(|x| x.parse::<u128>());
        let mut next = || -> Result<u128> { Ok(nums.next().context("short line")??) };
        match kind {
            "P" => pages = next()? as u64,
            "L" => {
                let (pin, hit) = (next()? as u64, next()? as u32);
                let chunks = nums.collect::<Result<_, _>>()?;
                events.push(Event::Lookup { pin, hit, chunks });
            }
            "S" => events.push(Event::Store(nums.collect::<Result<_, _>>()?)),
            "R" => {
                let pin = next()? as u64;
                let chunks = nums.collect::<Result<_, _>>()?;
                events.push(Event::Retrieve { pin, chunks });
            }
            "X" => events.push(Event::Release(next()? as u64)),
            _ => bail!("unknown line {line:?}"),
        }
    }
    Ok((pages, events))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let path = args
        .get(1)
        .context("usage: replay_events EVENTS.txt [POLICY] [PIN_PCT]")?;
    let policy: PolicyKind = args
        .get(2)
        .map_or("prefix-reuse", String::as_str)
        .parse()
        .map_err(|()| anyhow::anyhow!("unknown policy"))?;
    let pin_pct: f64 = args.get(3).map_or(Ok(50.0), |s| s.parse())?;
    let (pages, events) = parse(path)?;

    // The live run's mean pin lifetime, in events, for pins it did not give.
    let mut born: HashMap<u64, usize> = HashMap::new();
    let (mut lived, mut ended) = (0usize, 0usize);
    for (i, e) in events.iter().enumerate() {
        match e {
            Event::Lookup { pin, .. } if *pin != 0 => {
                born.insert(*pin, i);
            }
            Event::Retrieve { pin, .. } | Event::Release(pin) => {
                if let Some(b) = born.remove(pin) {
                    lived += i - b;
                    ended += 1;
                }
            }
            _ => {}
        }
    }
    let orphan_life = lived.checked_div(ended).unwrap_or(1000).max(1);

    let layout = kvd_gpu::PoolLayout::new(pages * PAGE_BYTES, PAGE_BYTES)?;
    let mut cache =
        Cache::new(PagePool::new(&layout), policy).with_lookup_pin_frac(pin_pct / 100.0);
    let class = cache.class_for(PAGE_BYTES)?;
    let demote_lag: Option<usize> = std::env::var("REPLAY_DEMOTE")
        .ok()
        .map(|v| v.parse())
        .transpose()?;
    let (kick, _kicked) = crossbeam_channel::bounded(1);
    // The reserve, in pages: an eighth of the pool unless REPLAY_MARGIN says otherwise
    // (`MIN-MAX`: paced to the drive between the two).
    let margin = std::env::var("REPLAY_MARGIN").unwrap_or_else(|_| (pages / 8).to_string());
    let (least, most): (u64, u64) = match margin.split_once('-') {
        Some((a, b)) => (a.parse()?, b.parse()?),
        None => (margin.parse()?, margin.parse()?),
    };
    if demote_lag.is_some() {
        cache.enable_paced_demotion(least * PAGE_BYTES, most * PAGE_BYTES, kick);
    }
    let (mut reserve_sum, mut busy_events, mut written) = (0u128, 0u64, 0u64);
    let mut demoting: VecDeque<(usize, EntryId, u128)> = VecDeque::new();
    let disk_model = demote_lag.is_some() && std::env::var("REPLAY_DISK").is_ok_and(|v| v == "1");
    let mut on_disk: std::collections::HashSet<u128> = std::collections::HashSet::new();
    let mut disk_hits = 0u64;
    let restore_writes = std::env::var("REPLAY_RESTORE_WRITES").is_ok_and(|v| v == "1");
    let write_rate: Option<f64> = std::env::var("REPLAY_WRITE_RATE")
        .ok()
        .map(|v| v.parse())
        .transpose()?;
    let mut write_credit = 0.0f64;
    let now = Instant::now();
    let ttl = Duration::from_secs(3600);
    // Live pin id -> (this replay's pin id, the chunks this replay's lookup reported).
    let mut pins: HashMap<u64, (u64, std::collections::HashSet<u128>)> = HashMap::new();
    let mut orphans: VecDeque<(usize, u64)> = VecDeque::new();
    let mut per_lookup: Vec<u32> = Vec::new();
    let (mut hits, mut live_hits, mut asked, mut gone, mut refused) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    for (i, e) in events.iter().enumerate() {
        if let Some(lag) = demote_lag {
            demoting.extend(
                cache
                    .take_demotions()
                    .into_iter()
                    .map(|d| (i + lag, d.ticket, d.key.hash)),
            );
            let mut done = Vec::new();
            let mut done_keys = Vec::new();
            if let Some(r) = write_rate {
                write_credit = (write_credit + r).min(r.max(1.0) * 4.0);
            }
            while demoting.front().is_some_and(|&(at, _, _)| at <= i)
                && write_rate.is_none_or(|_| write_credit >= 1.0)
            {
                if write_rate.is_some() {
                    write_credit -= 1.0;
                }
                let (_, ticket, hash) = demoting.pop_front().expect("front");
                done.push(ticket);
                done_keys.push(key(hash));
                on_disk.insert(hash);
            }
            written += done.len() as u64;
            cache.finish_demotions(&done);
            if !restore_writes {
                cache.known_on_disk(&done_keys);
            }
            busy_events += u64::from(!demoting.is_empty());
            reserve_sum += u128::from(cache.stats().disk_reserve_bytes / PAGE_BYTES);
        }
        while orphans.front().is_some_and(|&(at, _)| at <= i) {
            let (_, p) = orphans.pop_front().expect("front");
            cache.release(p);
        }
        match e {
            Event::Lookup { pin, hit, chunks } => {
                let (h, p) =
                    cache.lookup(1, &Query::prefix(1, 0, &[0], chunks).pinned(1), now, ttl);
                hits += u64::from(h);
                let mut filled = 0;
                if disk_model {
                    let keys: Vec<Key> = chunks[h as usize..]
                        .iter()
                        .take_while(|c| on_disk.contains(c))
                        .map(|&c| key(c))
                        .collect();
                    let ids: Vec<EntryId> = cache
                        .begin_fill(class, &keys)
                        .into_iter()
                        .map_while(|p| match p {
                            StorePlan::Write { entry, .. } => Some(entry),
                            _ => None,
                        })
                        .collect();
                    filled = ids.len() as u32;
                    cache.finish_store(&ids, true);
                    disk_hits += u64::from(filled);
                }
                per_lookup.push(h + filled);
                live_hits += u64::from(*hit);
                asked += chunks.len() as u64;
                if *pin != 0 {
                    let reported = chunks[..h as usize].iter().copied().collect();
                    pins.insert(*pin, (p, reported));
                } else if p != 0 {
                    orphans.push_back((i + orphan_life, p));
                }
            }
            Event::Store(chunks) => {
                let keys: Vec<Key> = chunks.iter().map(|&h| key(h)).collect();
                let plans = cache.begin_store(class, &keys);
                let ids: Vec<EntryId> = plans
                    .iter()
                    .filter_map(|p| match p {
                        StorePlan::Write { entry, .. } => Some(*entry),
                        StorePlan::Refused => {
                            refused += 1;
                            None
                        }
                        _ => None,
                    })
                    .collect();
                // As kvd does (`known_on_disk`): a chunk stored again while the disk holds
                // it takes none of the reserve when evicted (`REPLAY_RESTORE_WRITES=1`: it
                // does, as before).
                if disk_model && !restore_writes {
                    let held: Vec<Key> = plans
                        .iter()
                        .zip(&keys)
                        .filter(|(p, k)| {
                            matches!(p, StorePlan::Write { .. }) && on_disk.contains(&k.hash)
                        })
                        .map(|(_, k)| *k)
                        .collect();
                    cache.known_on_disk(&held);
                }
                cache.finish_store(&ids, true);
            }
            Event::Retrieve { pin, chunks } => {
                let keys: Vec<Key> = chunks.iter().map(|&h| key(h)).collect();
                // The live run's retrieves carry their lookup's pin (0 where it pinned nothing).
                let plans = cache.begin_retrieve(class, &keys, *pin == 0);
                let (p, reported) = pins.remove(pin).unwrap_or_default();
                // Only chunks this replay reported count as gone (the live run's retrieve
                // asks for what the live lookup reported).
                gone += chunks
                    .iter()
                    .zip(&plans)
                    .filter(|(c, plan)| plan.is_none() && reported.contains(c))
                    .count() as u64;
                let ids: Vec<EntryId> = plans.iter().flatten().map(|p| p.entry).collect();
                cache.finish_retrieve(&ids, (p != 0).then_some((p, 0)));
            }
            Event::Release(pin) => {
                if let Some((p, _)) = pins.remove(pin) {
                    cache.release(p);
                }
            }
        }
    }
    if let Ok(out) = std::env::var("REPLAY_HITS_OUT") {
        let text: Vec<String> = per_lookup.iter().map(u32::to_string).collect();
        std::fs::write(out, text.join("\n"))?;
    }
    let s = cache.stats();
    println!(
        "policy {policy:?} pin_pct {pin_pct} pages {pages}: hits {hits} (live run {live_hits}) of {asked}; disk hits {disk_hits}; \
         retrieved chunks gone {gone}; refused {refused}; reported unpinned {}; evictions {}; unreachable at end {}",
        s.counters.pin_budget_chunks, s.counters.evictions, s.unreachable_chunks
    );
    if demote_lag.is_some() {
        println!(
            "reserve: {} pages at the end, {} on average; victims written {written}, dropped for want of it {}; drive busy {:.3} of events",
            s.disk_reserve_bytes / PAGE_BYTES,
            reserve_sum / events.len().max(1) as u128,
            cache.demotions_skipped(),
            busy_events as f64 / events.len().max(1) as f64
        );
    }
    Ok(())
}
