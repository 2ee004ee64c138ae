//! What the L2 tests share: kvd started with an L2, stores, retrieves and lookups of chained
//! chunks of the small cache ([`super::small`]), and waits on metrics and on L2's health.

use std::time::{Duration, Instant};

use kvd_proto::client::Client;
use kvd_proto::wire::*;

pub use super::small::*;
pub use super::Running;
use super::*;

pub const FP: u64 = 0x6c32;
pub fn kvd_l2(url: &str, extra: &[&str]) -> Kvd {
    let mut args = vec!["--chunk-tokens", "32", "--l2", url];
    args.extend_from_slice(extra);
    Kvd::ready(&args)
}

pub async fn store(client: &Client, reg: &Registered, h: &[u128], first_block: u32) {
    let reply = client
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks: chunks(h, &blocks_of(first_block, h.len())),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(reply.outcomes, vec![StoreOutcome::Stored; h.len()]);
}

pub async fn retrieve(client: &Client, reg: &Registered, pin: u64, h: &[u128], first_block: u32) {
    let reply = client
        .retrieve(Retrieve {
            region: reg.region,
            salt: 0,
            pin_id: pin,
            chunks: chunks(h, &blocks_of(first_block, h.len())),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(reply.outcomes, vec![RetrieveOutcome::Loaded; h.len()]);
}

/// Asserts that `dst`'s blocks from `dst_first` hold what `src`'s from `src_first` held.
pub fn assert_same_blocks(src: &[Vec<u8>], dst: &HostKv, dst_first: u32) {
    for (i, want) in src.iter().enumerate() {
        assert!(
            dst.block_bytes(dst_first + i as u32) == *want,
            "block {i} differs after the trip through L2"
        );
    }
}

pub fn lookup(fingerprint: u64, shards: &[u32], h: &[u128], pin: bool, readers: u16) -> Lookup {
    Lookup {
        fingerprint,
        salt: 0,
        shards: shards.to_vec(),
        hashes: h.to_vec(),
        pin,
        readers,
        held: 0,
    }
}

/// Waits until a metric reaches `at_least`.
pub fn wait_metric(kvd: &Kvd, prefix: &str, at_least: f64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let v = kvd.metric(prefix);
        if v >= at_least {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{prefix} stayed at {v}, wanted {at_least}; log:\n{}",
            kvd.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub const WRITTEN: &str = r#"kvd_l2_write_behind_total{outcome="written""#;

/// The L2 section of /healthz (which must answer 200 whatever L2 does).
pub fn l2_health(kvd: &Kvd) -> serde_json::Value {
    let (code, body) = kvd.get("/healthz");
    assert_eq!(code, 200, "L2 never makes kvd unhealthy: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["l2"].clone()
}

/// Waits until /healthz reports L2 `want` (and, for "down", says why).
pub fn wait_l2_state(kvd: &Kvd, want: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let h = l2_health(kvd);
        if h["state"] == want && (want == "up" || h["last_error"].is_string()) {
            return h;
        }
        assert!(Instant::now() < deadline, "L2 stayed {h}, wanted {want}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Repeats a lookup until it hits `want` chunks (kvd reconnects and retries L2 by itself, within
/// seconds); returns its pin.
pub async fn lookup_until(kvd: &Kvd, client: &Client, l: Lookup, want: u32) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let hit = client.lookup(l.clone()).await.unwrap();
        if hit.hit_chunks == want {
            return hit.pin_id;
        }
        if hit.pin_id != 0 {
            client
                .release(Release { pin_id: hit.pin_id })
                .await
                .unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "lookup found {} of {want} chunks; L2 {}; log:\n{}",
            hit.hit_chunks,
            l2_health(kvd),
            kvd.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
