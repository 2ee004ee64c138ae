//! The removal feed against a real kvd: chunks stored into a small pool, more stored to force
//! evictions, and the feed must name exactly the chunks that lookups no longer find — with the
//! fingerprint, salt and shard the client stored them under — and, once its ring overflows, say
//! how many records a reader missed.

mod common;

use std::collections::HashSet;

use common::*;
use kvd_proto::client::Client;
use kvd_proto::wire::*;

const FP: u64 = 0xE7E7;
const SALT: u64 = 0x5A17;
const BLOCKS: u32 = 64;

/// 8 MiB pool of 2 MiB slabs; 32-token chunks of 2 blocks of 8 KiB: 512 pages. FIFO, so the
/// victims are the oldest chunks and the feed's order can be checked.
fn start(extra: &[&str]) -> InProcess {
    let mut args = vec![
        "--l1-size-gb",
        "0.0078125",
        "--chunk-tokens",
        "32",
        "--eviction",
        "fifo",
    ];
    args.extend_from_slice(extra);
    InProcess::ready(&args)
}

/// Stores `hashes` into `reg` under [`SALT`]; every chunk must be stored.
async fn store(client: &Client, reg: &Registered, hashes: &[u128]) {
    let per = reg.chunk_blocks;
    for batch in hashes.chunks(256) {
        let chunks = batch
            .iter()
            .enumerate()
            .map(|(c, &h)| chunk(h, (0..per).map(|i| (c as u32 * per + i) % BLOCKS).collect()))
            .collect();
        let r = client
            .store(Store {
                region: reg.region,
                salt: SALT,
                chunks,
                wait_slot: None,
                deadline_ns: 0,
            })
            .await
            .unwrap();
        assert!(
            r.outcomes.iter().all(|o| *o == StoreOutcome::Stored),
            "{:?}",
            r.outcomes
        );
    }
}

async fn stored(client: &Client, shard: u32, hash: u128) -> bool {
    let l = Lookup {
        fingerprint: FP,
        salt: SALT,
        shards: vec![shard],
        hashes: vec![hash],
        pin: false,
        readers: 1,
        held: 0,
    };
    client.lookup(l).await.unwrap().hit_chunks == 1
}

/// Reads the whole feed after `since` in pages of `max`; returns the records, the last `next`
/// and the dropped count summed.
async fn read_all(client: &Client, mut since: u64, max: u32) -> (Vec<RemovedChunk>, u64, u64) {
    let (mut records, mut dropped) = (Vec::new(), 0);
    loop {
        let r = client.events(Events { since, max }).await.unwrap();
        assert!(r.records.len() <= max as usize);
        dropped += r.dropped;
        let done = r.records.is_empty();
        assert_eq!(
            r.next,
            since + r.dropped + r.records.len() as u64,
            "next accounts for every record sent or dropped"
        );
        since = r.next;
        records.extend(r.records);
        if done {
            return (records, since, dropped);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_feed_names_exactly_the_evicted_chunks() {
    let kvd = start(&[]);
    let client = kvd.client("events").await;
    let (kv0, kv1) = (
        HostKv::vllm("BLNHC", 2, BLOCKS, 2, 16, 64, 2),
        HostKv::vllm("BLNHC", 2, BLOCKS, 2, 16, 64, 2),
    );
    let regs = [
        kv0.register(&client, FP, 0).await.unwrap(),
        kv1.register(&client, FP, 1).await.unwrap(),
    ];
    // Filling the pool evicts nothing.
    let first: Vec<u128> = (0..256).map(|i| 0xA000 + i).collect();
    store(&client, &regs[0], &first).await;
    store(&client, &regs[1], &first).await;
    let empty = client.events(Events { since: 0, max: 100 }).await.unwrap();
    assert_eq!((empty.records.len(), empty.next, empty.dropped), (0, 0, 0));

    // 300 more on shard 1 evict the 300 oldest chunks: all of shard 0's, then 44 of shard 1's.
    let more: Vec<u128> = (0..300).map(|i| 0xB000 + i).collect();
    store(&client, &regs[1], &more).await;
    let mut gone = Vec::new();
    for (shard, hashes) in [(0, &first), (1, &first), (1, &more)] {
        for &h in hashes {
            if !stored(&client, shard, h).await {
                gone.push((shard, h));
            }
        }
    }
    assert_eq!(gone.len(), 300, "a full pool of 512 pages took 812 chunks");

    let (records, next, dropped) = read_all(&client, 0, 70).await;
    assert_eq!((next, dropped), (300, 0));
    for r in &records {
        assert_eq!((r.fingerprint, r.salt), (FP, SALT), "{r:?}");
    }
    let keys: Vec<(u32, u128)> = records.iter().map(|r| (r.shard, r.hash)).collect();
    assert_eq!(
        keys.iter().collect::<HashSet<_>>().len(),
        keys.len(),
        "no chunk twice"
    );
    assert_eq!(keys, gone, "exactly the chunks lookups miss, oldest first");
    assert_eq!(kvd.metric("kvd_evictions_total"), 300.0);

    // Caught up, and "from now": nothing new, and the position stays.
    for since in [300, u64::MAX] {
        let r = client.events(Events { since, max: 100 }).await.unwrap();
        assert_eq!((r.records.len(), r.next, r.dropped), (0, 300, 0));
    }
    // One reply carries at most MAX_EVENTS_PER_REPLY records, whatever max asks.
    let flood: Vec<u128> = (0..MAX_EVENTS_PER_REPLY as u128)
        .map(|i| 0xC000 + i)
        .collect();
    store(&client, &regs[0], &flood).await;
    let r = client
        .events(Events {
            since: 0,
            max: u32::MAX,
        })
        .await
        .unwrap();
    assert_eq!(r.records.len(), MAX_EVENTS_PER_REPLY as usize);
    assert_eq!(r.next, u64::from(MAX_EVENTS_PER_REPLY));
    assert_eq!(kvd.metric("kvd_events_dropped_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflowed_ring_says_how_many_records_a_reader_missed() {
    let kvd = start(&["--events-capacity", "16"]);
    let client = kvd.client("events").await;
    let kv = HostKv::vllm("BLNHC", 2, BLOCKS, 2, 16, 64, 2);
    let reg = kv.register(&client, FP, 3).await.unwrap();
    let hashes: Vec<u128> = (0..612).map(|i| 0xD000 + i).collect();
    store(&client, &reg, &hashes).await;
    // 100 evicted (the 100 oldest); the ring keeps the newest 16 records.
    let behind = client.events(Events { since: 0, max: 10 }).await.unwrap();
    assert_eq!(behind.dropped, 84);
    let got: Vec<u128> = behind.records.iter().map(|r| r.hash).collect();
    assert_eq!(got, hashes[84..94].to_vec());
    assert_eq!(behind.next, 94);
    assert!(behind.records.iter().all(|r| r.shard == 3));
    assert_eq!(kvd.metric("kvd_events_dropped_total"), 84.0);
    // The rest of the ring, then nothing: a reader that kept its place loses nothing more.
    let (rest, next, dropped) = read_all(&client, behind.next, 100).await;
    assert_eq!((rest.len(), next, dropped), (6, 100, 0));
    // A reader that started inside the ring drops nothing either.
    let r = client
        .events(Events {
            since: 90,
            max: 100,
        })
        .await
        .unwrap();
    assert_eq!((r.records.len(), r.next, r.dropped), (10, 100, 0));
    // Another 20 evictions overwrite the ring: a reader left at 100 misses 4.
    let more: Vec<u128> = (0..20).map(|i| 0xE000 + i).collect();
    store(&client, &reg, &more).await;
    let r = client
        .events(Events {
            since: 100,
            max: 100,
        })
        .await
        .unwrap();
    assert_eq!((r.records.len(), r.next, r.dropped), (16, 120, 4));
    assert_eq!(r.records[0].hash, hashes[104]);
    assert_eq!(kvd.metric("kvd_events_dropped_total"), 88.0);
}

#[test]
fn the_capacity_flag_is_checked() {
    let out = std::process::Command::new(kvd_bin())
        .args(["serve", "--events-capacity", "0", "--l1-size-gb", "0.01"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--events-capacity 0"), "{err}");
}
