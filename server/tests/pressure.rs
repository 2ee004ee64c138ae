//! Eviction under pressure: concurrent clients store far more than the pool holds while others
//! look up and retrieve. Every retrieved chunk must be exactly what was stored under its key,
//! pinned chunks must survive, and a pool full of pinned pages must refuse stores, say so, and
//! count them.

mod common;

use std::sync::Arc;

use common::*;
use kvd_proto::client::Client;
use kvd_proto::wire::*;

const FP: u64 = 0x5157;
// BLNHC, 2 layers × 2 heads × 16 tokens × 64 content × 2 bytes: 8 KiB per block of all
// layers; a 32-token chunk is 2 blocks, a 16 KiB page.
const BLOCKS: u32 = 64;

fn cache() -> HostKv {
    HostKv::vllm("BLNHC", 2, BLOCKS, 2, 16, 64, 2)
}

fn block_stride(kv: &HostKv) -> u64 {
    kv.layout.block_stride_bytes
}

/// The bytes chunk `hash` carries in its block `i`.
fn content(hash: u128, i: u32, len: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    Rng(
        (hash as u64) ^ ((hash >> 64) as u64) ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            | 1,
    )
    .fill(&mut v);
    v
}

async fn store_chunks(
    client: &Client,
    kv: &HostKv,
    reg: &Registered,
    hashes: &[u128],
) -> Vec<StoreOutcome> {
    let per = reg.chunk_blocks;
    let bs = block_stride(kv);
    let mut chunks = Vec::new();
    for (c, &h) in hashes.iter().enumerate() {
        let blocks: Vec<u32> = (0..per).map(|i| (c as u32 * per + i) % BLOCKS).collect();
        for (i, &b) in blocks.iter().enumerate() {
            kv.allocations[0]
                .write(b as u64 * bs, &content(h, i as u32, bs))
                .unwrap();
        }
        chunks.push(chunk(h, blocks));
    }
    client
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks,
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap()
        .outcomes
}

/// Retrieves into the top blocks and checks every loaded chunk; returns how many loaded.
async fn retrieve_and_check(
    client: &Client,
    kv: &HostKv,
    reg: &Registered,
    hashes: &[u128],
    pin_id: u64,
) -> usize {
    let per = reg.chunk_blocks;
    let bs = block_stride(kv);
    let mut loaded = 0;
    for &h in hashes {
        let blocks: Vec<u32> = (0..per).map(|i| BLOCKS - per + i).collect();
        let r = client
            .retrieve(Retrieve {
                region: reg.region,
                salt: 0,
                pin_id,
                chunks: vec![chunk(h, blocks.clone())],
                wait_slot: None,
                deadline_ns: 0,
            })
            .await
            .unwrap();
        if r.outcomes[0] == RetrieveOutcome::Loaded {
            loaded += 1;
            for (i, &b) in blocks.iter().enumerate() {
                let got = kv.allocations[0]
                    .read_vec(b as u64 * bs, bs as usize)
                    .unwrap();
                assert!(
                    got == content(h, i as u32, bs),
                    "chunk {h:x} came back with other bytes"
                );
            }
        }
    }
    loaded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_clients_overflow_the_pool_and_every_hit_is_exact() {
    // 64 MiB pool: 4096 pages of 16 KiB. 8 clients store 800 chunks each.
    let kvd = Arc::new(InProcess::ready(&[
        "--l1-size-gb",
        "0.0625",
        "--chunk-tokens",
        "32",
    ]));
    let mut tasks = Vec::new();
    for w in 0..8u128 {
        let kvd = kvd.clone();
        tasks.push(tokio::spawn(async move {
            let client = kvd.client(&format!("w{w}")).await;
            let kv = cache();
            let reg = kv.register(&client, FP, w as u32).await.unwrap();
            let mut rng = Rng(w as u64 + 1);
            let mut stored = 0;
            let mut loaded = 0;
            for batch in 0..100u128 {
                let hashes: Vec<u128> = (0..8).map(|i| (w << 96) | (batch << 8) | i).collect();
                let out = store_chunks(&client, &kv, &reg, &hashes).await;
                stored += out.iter().filter(|o| **o == StoreOutcome::Stored).count();
                // Look back at a random earlier batch.
                let back = rng.below(batch as u64 + 1) as u128;
                let old: Vec<u128> = (0..8).map(|i| (w << 96) | (back << 8) | i).collect();
                let l = Lookup {
                    fingerprint: FP,
                    salt: 0,
                    shards: vec![w as u32],
                    hashes: old.clone(),
                    pin: true,
                    readers: 1,
                    held: 0,
                };
                let hit = client.lookup(l).await.unwrap();
                loaded += retrieve_and_check(
                    &client,
                    &kv,
                    &reg,
                    &old[..hit.hit_chunks as usize],
                    hit.pin_id,
                )
                .await;
                if hit.pin_id != 0 {
                    client
                        .release(Release { pin_id: hit.pin_id })
                        .await
                        .unwrap();
                }
            }
            (stored, loaded)
        }));
    }
    let mut stored = 0;
    let mut loaded = 0;
    for t in tasks {
        let (s, l) = t.await.unwrap();
        stored += s;
        loaded += l;
    }
    assert_eq!(
        stored, 6400,
        "with nothing pinned for long, every store finds a page"
    );
    assert!(loaded > 100, "lookbacks found data ({loaded})");
    let evictions = kvd.metric("kvd_evictions_total");
    assert!(evictions >= 6400.0 - 4096.0, "evictions {evictions}");
    assert_eq!(kvd.metric("kvd_pool_pinned_pages"), 0.0);
    let used = kvd.metric("kvd_pool_used_bytes");
    assert_eq!(
        used,
        kvd.metric("kvd_pool_bytes"),
        "a full pool after overflow"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pinned_chunks_survive_a_flood_and_a_pinned_pool_refuses_stores() {
    // 8 MiB pool of 2 MiB slabs: 512 pages, all of which lookups may pin.
    let kvd = InProcess::ready(&[
        "--l1-size-gb",
        "0.0078125",
        "--chunk-tokens",
        "32",
        "--lookup-pin-pct",
        "100",
    ]);
    let pinner = kvd.client("pinner").await;
    let kv = cache();
    let reg = kv.register(&pinner, FP, 0).await.unwrap();
    let keep: Vec<u128> = (0..100).map(|i| 0xC0FFEE00 + i).collect();
    for batch in keep.chunks(10) {
        assert!(store_chunks(&pinner, &kv, &reg, batch)
            .await
            .iter()
            .all(|o| *o == StoreOutcome::Stored));
    }
    let pin = pinner
        .lookup(Lookup {
            fingerprint: FP,
            salt: 0,
            shards: vec![0],
            hashes: keep.clone(),
            pin: true,
            readers: 1,
            held: 0,
        })
        .await
        .unwrap();
    assert_eq!(pin.hit_chunks, 100);

    let flooder = kvd.client("flooder").await;
    let kv2 = cache();
    let reg2 = kv2.register(&flooder, FP, 1).await.unwrap();
    for batch in 0..200u128 {
        let hashes: Vec<u128> = (0..8).map(|i| (batch << 8) | i).collect();
        let out = store_chunks(&flooder, &kv2, &reg2, &hashes).await;
        assert!(out.iter().all(|o| *o == StoreOutcome::Stored));
    }
    assert_eq!(
        retrieve_and_check(&pinner, &kv, &reg, &keep, 0).await,
        100,
        "pinned chunks survived"
    );

    // Pin everything the flooder has left, then its next store cannot get a page.
    let mut all = Vec::new();
    for batch in 0..200u128 {
        all.extend((0..8).map(|i| (batch << 8) | i));
    }
    let mut pinned = 100;
    for h in all {
        let l = flooder
            .lookup(Lookup {
                fingerprint: FP,
                salt: 0,
                shards: vec![1],
                hashes: vec![h],
                pin: true,
                readers: 1,
                held: 0,
            })
            .await
            .unwrap();
        pinned += l.hit_chunks as usize;
    }
    assert_eq!(pinned, 512, "every page holds a pinned chunk");
    let out = store_chunks(&flooder, &kv2, &reg2, &[1 << 100, 2 << 100, 3 << 100]).await;
    assert_eq!(
        out,
        vec![StoreOutcome::RefusedPoolFull; 3],
        "every chunk is tried, none skipped"
    );
    assert_eq!(
        kvd.metric("kvd_store_chunks_total{outcome=\"refused_pool_full\""),
        3.0
    );
    assert_eq!(
        kvd.metric("kvd_store_chunks_total{outcome=\"skipped\""),
        0.0
    );
    assert_eq!(
        kvd.metric("kvd_store_refusals_total{reason=\"pinned\""),
        3.0
    );
    // Refused chunks are not reported as stored.
    let l = flooder
        .lookup(Lookup {
            fingerprint: FP,
            salt: 0,
            shards: vec![1],
            hashes: vec![1 << 100],
            pin: false,
            readers: 1,
            held: 0,
        })
        .await
        .unwrap();
    assert_eq!(l.hit_chunks, 0);
    let (code, _) = kvd.get("/healthz");
    assert_eq!(code, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_model_grows_into_a_pool_the_first_one_filled() {
    // 8 MiB pool of 2 MiB slabs. Model A (16 KiB pages) fills it; then model B (4 layers: 32 KiB
    // pages, 64 per slab) stores 200 chunks while A is idle. B must get the pool, not just the
    // one slab it could take when A held them all.
    let kvd = InProcess::ready(&["--l1-size-gb", "0.0078125", "--chunk-tokens", "32"]);
    let client = kvd.client("two-models").await;
    let a = cache();
    let ra = a.register(&client, FP, 0).await.unwrap();
    let b = HostKv::vllm("BLNHC", 4, BLOCKS, 2, 16, 64, 2);
    let rb = b.register(&client, FP + 1, 0).await.unwrap();
    assert_eq!((ra.page_bytes, rb.page_bytes), (16 << 10, 32 << 10));
    for batch in 0..60u128 {
        let hashes: Vec<u128> = (0..10).map(|i| 0xA000 + batch * 10 + i).collect();
        store_chunks(&client, &a, &ra, &hashes).await;
    }
    assert_eq!(
        kvd.metric("kvd_pool_used_bytes"),
        kvd.metric("kvd_pool_bytes")
    );
    let b_hashes: Vec<u128> = (0..200).map(|i| 0xB000 + i).collect();
    for batch in b_hashes.chunks(10) {
        let out = store_chunks(&client, &b, &rb, batch).await;
        assert!(out.iter().all(|o| *o == StoreOutcome::Stored), "{out:?}");
    }
    let loaded = retrieve_and_check(&client, &b, &rb, &b_hashes, 0).await;
    assert_eq!(
        loaded, 200,
        "every chunk of the second model is kept, byte-exact"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_pins_hold_half_the_pool_and_stores_keep_finding_pages() {
    // 512 pages; lookup pins may hold 256 of them (the default --lookup-pin-pct 50).
    let kvd = InProcess::ready(&["--l1-size-gb", "0.0078125", "--chunk-tokens", "32"]);
    let client = kvd.client("pins").await;
    let kv = cache();
    let reg = kv.register(&client, FP, 0).await.unwrap();
    let hashes: Vec<u128> = (0..400).map(|i| 0xD00D_0000 + i).collect();
    for batch in hashes.chunks(50) {
        let out = store_chunks(&client, &kv, &reg, batch).await;
        assert!(out.iter().all(|o| *o == StoreOutcome::Stored));
    }
    // Lookups of waiting requests pin all they may.
    let mut pinned = 0;
    for batch in hashes.chunks(100) {
        let l = client
            .lookup(Lookup {
                fingerprint: FP,
                salt: 0,
                shards: vec![0],
                hashes: batch.to_vec(),
                pin: true,
                readers: 1,
                held: 0,
            })
            .await
            .unwrap();
        pinned += l.hit_chunks;
    }
    assert_eq!(pinned, 400, "every hit is reported");
    assert_eq!(
        kvd.metric("kvd_pool_pinned_pages"),
        256.0,
        "pins stop at half the pool"
    );
    assert_eq!(
        kvd.metric("kvd_lookup_pin_budget_chunks_total"),
        (400 - 256) as f64
    );
    assert_eq!(
        kvd.metric("kvd_lookup_held_chunks"),
        (400 - 256) as f64,
        "the rest held (the default --lookup-hold-pct 50 has room)"
    );
    // A store of more than the unpinned pages left still gets a page for every chunk (held
    // chunks go when nothing else can: the cache's unit tests).
    let more: Vec<u128> = (0..200).map(|i| 0xBEEF_0000 + i).collect();
    for batch in more.chunks(50) {
        let out = store_chunks(&client, &kv, &reg, batch).await;
        assert!(out.iter().all(|o| *o == StoreOutcome::Stored), "{out:?}");
    }
    assert_eq!(
        kvd.metric("kvd_store_refusals_total{reason=\"pinned\""),
        0.0
    );
    let (_, body) = kvd.get("/metrics");
    assert!(
        body.contains("kvd_unreachable_bytes "),
        "the gauge is exported"
    );
}
