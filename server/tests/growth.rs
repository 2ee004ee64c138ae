//! The pool grows in the background while kvd serves: against a real kvd whose pool takes
//! seconds to populate, a store, a lookup hit and a bit-exact retrieve all succeed before the
//! pool is full, and what was stored survives the rest of the growth.

mod common;

use std::time::{Duration, Instant};

use common::*;
use kvd_proto::wire::*;

const FINGERPRINT: u64 = 0x960;

async fn hits(client: &kvd_proto::client::Client, hashes: &[u128]) -> u32 {
    client
        .lookup(Lookup {
            fingerprint: FINGERPRINT,
            salt: 0,
            shards: vec![0],
            hashes: hashes.to_vec(),
            pin: false,
            readers: 1,
            held: 0,
        })
        .await
        .unwrap()
        .hit_chunks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_and_a_hit_succeed_while_the_pool_is_still_growing() {
    // 4 GiB on 4 KiB pages, first-touched by one thread: seconds of growth on a CI machine
    // (at least ~0.5 s even at 8 GB/s), against milliseconds for the requests below. The first
    // step is one 64 MiB slab.
    let started = Instant::now();
    let kvd = Kvd::start(&[
        "--l1-size-gb",
        "4",
        "--slab-mb",
        "64",
        "--populate-threads",
        "1",
        "--no-hugepages",
        "--chunk-tokens",
        "64",
    ]);
    kvd.wait_healthy(Duration::from_secs(30));
    let serving_after = started.elapsed();
    let pool = kvd.pool_status();
    let total = pool["total_bytes"].as_u64().unwrap();
    let ready = pool["ready_bytes"].as_u64().unwrap();
    assert_eq!(total, 4 << 30, "{pool}");
    assert!(ready >= 64 << 20, "200 only once a slab is ready: {pool}");
    assert_eq!(pool["state"], "growing", "{pool}");

    let client = kvd.client("growth").await;
    let kv = HostKv::vllm("BLNHC", 4, 40, 2, 16, 32, 2);
    let mut rng = Rng(0x5eed);
    kv.fill_random(&mut rng);
    let reg = kv.register(&client, FINGERPRINT, 0).await.unwrap();
    let per_chunk = reg.chunk_blocks;
    let n = 4u32;
    let src: Vec<Vec<u32>> = (0..n)
        .map(|c| (c * per_chunk..(c + 1) * per_chunk).collect())
        .collect();
    let dst: Vec<Vec<u32>> = (0..n)
        .map(|c| ((n + c) * per_chunk..(n + c + 1) * per_chunk).collect())
        .collect();
    let hashes: Vec<u128> = (0..n as u128).map(|i| 0xabc0 + i).collect();
    let expected: Vec<Vec<u8>> = src.iter().flatten().map(|&b| kv.block_bytes(b)).collect();

    let stored = client
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks: chunks(&hashes, &src),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(stored.outcomes, vec![StoreOutcome::Stored; n as usize]);
    assert_eq!(hits(&client, &hashes).await, n);
    let got = client
        .retrieve(Retrieve {
            region: reg.region,
            salt: 0,
            pin_id: 0,
            chunks: chunks(&hashes, &dst),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(got.outcomes, vec![RetrieveOutcome::Loaded; n as usize]);
    let back: Vec<Vec<u8>> = dst.iter().flatten().map(|&b| kv.block_bytes(b)).collect();
    assert!(
        back == expected,
        "retrieved blocks differ from the stored ones"
    );
    let hit_after = started.elapsed();

    // Only now: all of the above happened before the pool was full.
    let pool = kvd.pool_status();
    assert_eq!(
        pool["state"], "growing",
        "the pool filled before the hit, so this run proves nothing; raise --l1-size-gb here: {pool}"
    );
    assert!(kvd.metric("kvd_pool_ready_bytes") < kvd.metric("kvd_pool_bytes"));

    kvd.wait_pool_full(Duration::from_secs(120));
    let pool = kvd.pool_status();
    assert_eq!(pool["ready_bytes"], total, "{pool}");
    assert_eq!(
        hits(&client, &hashes).await,
        n,
        "growth lost what was stored"
    );
    eprintln!(
        "serving after {:.2} s, store+hit+retrieve done at {:.2} s, pool full after {} s \
         ({} GB/s)",
        serving_after.as_secs_f64(),
        hit_after.as_secs_f64(),
        pool["full_after_s"],
        pool["gb_per_s"]
    );
}

#[test]
fn sigterm_while_the_pool_grows_exits_cleanly() {
    let mut kvd = Kvd::start(&[
        "--l1-size-gb",
        "4",
        "--slab-mb",
        "64",
        "--populate-threads",
        "1",
        "--no-hugepages",
    ]);
    kvd.wait_healthy(Duration::from_secs(30));
    assert_eq!(kvd.pool_status()["state"], "growing");
    let (status, took) = kvd.terminate();
    assert!(status.success(), "{status:?}; log:\n{}", kvd.log());
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(
        kvd.log().contains("stopped growing the pool"),
        "{}",
        kvd.log()
    );
}
