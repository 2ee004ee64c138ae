//! The L2 tier against real Valkey/Redis servers on loopback: two kvd "nodes" sharing one
//! 3-master cluster (TP shards and MLA), values damaged in the server, and the faults L2 must
//! survive — unreachable, slow, full, a cluster node killed mid-run — while L1 keeps serving.

mod common;

use std::time::{Duration, Instant};

use common::l2::*;
use common::redis_servers::{free_port, RedisCluster, RedisServer};
use kvd_proto::wire::*;
use rustix::process::Signal;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_stored_through_one_node_is_read_bit_exact_through_another() {
    let cluster = RedisCluster::start(3);
    let a = kvd_l2(&cluster.url(), &[]);
    let b = kvd_l2(&cluster.url(), &[]);
    let (ca, cb) = (a.client("node-a").await, b.client("node-b").await);
    assert_eq!(wait_l2_state(&a, "up")["url"], cluster.url());

    // Tensor parallel, two ranks: each stores its own shard on node A.
    let n = 12;
    let h = hashes(0, n);
    let mut src = Vec::new();
    for shard in 0..2u32 {
        let kv = cache(10 + shard as u64);
        let reg = kv.register(&ca, FP, shard).await.unwrap();
        store(&ca, &reg, &h, 0).await;
        let bytes: Vec<Vec<u8>> = (0..n as u32 * PER).map(|b| kv.block_bytes(b)).collect();
        src.push(bytes);
    }
    wait_metric(&a, WRITTEN, (2 * n) as f64);
    for node in &cluster.nodes {
        assert!(
            !node.kvd_keys().is_empty(),
            "every shard of the cluster holds some chunks"
        );
    }

    // Node B has never seen them: its lookup brings them from L2 into L1, pinned.
    let mut dst = Vec::new();
    for shard in 0..2u32 {
        let kv = cache(90 + shard as u64);
        let reg = kv.register(&cb, FP, shard).await.unwrap();
        dst.push((kv, reg));
    }
    let hit = cb.lookup(lookup(FP, &[0, 1], &h, true, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, n as u32);
    assert_ne!(hit.pin_id, 0);
    for (shard, (kv, reg)) in dst.iter().enumerate() {
        retrieve(&cb, reg, hit.pin_id, &h, 30).await;
        assert_same_blocks(&src[shard], kv, 30);
    }
    assert_eq!(b.metric("kvd_lookup_pins"), 0.0, "both ranks read");
    assert_eq!(
        b.metric(r#"kvd_l2_lookup_chunks_total{result="hit""#),
        n as f64
    );
    assert_eq!(b.metric("kvd_l2_rejected_values_total"), 0.0);
    assert_eq!(
        b.metric(r#"kvd_l2_bytes_total{direction="read""#),
        a.metric(r#"kvd_l2_bytes_total{direction="write""#),
        "B read every byte A wrote"
    );
    // Chunks fetched from L2 are not written back to it.
    assert_eq!(b.metric("kvd_l2_write_behind_queued_total"), 0.0);

    // MLA: stored once (shard 0) through A, read by two ranks on B under one pin.
    const MLA: u64 = 0x41a;
    let hm = hashes(5000, 4);
    let kv = cache(7);
    let reg = kv.register(&ca, MLA, 0).await.unwrap();
    store(&ca, &reg, &hm, 0).await;
    let src: Vec<Vec<u8>> = (0..4 * PER).map(|b| kv.block_bytes(b)).collect();
    wait_metric(&a, WRITTEN, (2 * n + 4) as f64);
    let ranks = [b.client("rank0").await, b.client("rank1").await];
    let mut regs = Vec::new();
    for (r, c) in ranks.iter().enumerate() {
        let kv = cache(70 + r as u64);
        let reg = kv.register(c, MLA, 0).await.unwrap();
        regs.push((kv, reg));
    }
    let hit = cb.lookup(lookup(MLA, &[0], &hm, true, 2)).await.unwrap();
    assert_eq!(hit.hit_chunks, 4);
    for (c, (kv, reg)) in ranks.iter().zip(&regs) {
        retrieve(c, reg, hit.pin_id, &hm, 40).await;
        assert_same_blocks(&src, kv, 40);
    }
    assert_eq!(
        b.metric("kvd_lookup_pins"),
        0.0,
        "the pin ends after both ranks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_truncated_foreign_or_corrupt_in_l2_never_reach_the_pool() {
    let server = RedisServer::start(&[]);
    let a = kvd_l2(&server.url(), &[]);
    let ca = a.client("writer").await;
    let kv = cache(1);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let h = hashes(0, 4);
    store(&ca, &reg, &h, 0).await;
    wait_metric(&a, WRITTEN, 4.0);
    let src: Vec<Vec<u8>> = (0..PER).map(|b| kv.block_bytes(b)).collect();

    // Keys are namespaced by fingerprint, salt and shard.
    let name = |hash: u128| format!("kvd:1:{FP:016x}:{:016x}:0:{hash:032x}", 0);
    let mut keys = server.kvd_keys();
    keys.sort();
    let mut want: Vec<String> = h.iter().map(|&x| name(x)).collect();
    want.sort();
    assert_eq!(keys, want);

    // Chunk 1 corrupt (one payload bit), 2 truncated, 3 a copy of chunk 0 (foreign).
    let v0 = server.get(&name(h[0])).unwrap();
    let mut v1 = server.get(&name(h[1])).unwrap();
    let last = v1.len() - 1;
    v1[last] ^= 0x10;
    server.set(&name(h[1]), &v1);
    let v2 = server.get(&name(h[2])).unwrap();
    server.set(&name(h[2]), &v2[..v2.len() / 2]);
    server.set(&name(h[3]), &v0);

    let b = kvd_l2(&server.url(), &[]);
    let cb = b.client("reader").await;
    let dst = cache(2);
    let reg_b = dst.register(&cb, FP, 0).await.unwrap();
    wait_l2_state(&b, "up");
    let hit = cb.lookup(lookup(FP, &[0], &h, true, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 1, "only chunk 0 is intact");
    retrieve(&cb, &reg_b, hit.pin_id, &h[..1], 20).await;
    assert_same_blocks(&src, &dst, 20);
    assert_eq!(
        b.metric(r#"kvd_l2_rejected_values_total{reason="corrupt""#),
        1.0
    );
    for (i, reason) in [(2, "truncated"), (3, "foreign")] {
        let hit = cb
            .lookup(lookup(FP, &[0], &h[i..=i], false, 1))
            .await
            .unwrap();
        assert_eq!(hit.hit_chunks, 0, "chunk {i} is {reason}");
        assert_eq!(
            b.metric(&format!(
                "kvd_l2_rejected_values_total{{reason=\"{reason}\""
            )),
            1.0
        );
    }
    assert_eq!(
        b.metric("kvd_pool_chunks"),
        1.0,
        "no rejected value took a page"
    );
    // What L1 holds is still served.
    let hit = cb
        .lookup(lookup(FP, &[0], &h[..1], false, 1))
        .await
        .unwrap();
    assert_eq!(hit.hit_chunks, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvd_serves_from_l1_while_l2_is_unreachable_slow_or_full() {
    // Unreachable at start: kvd starts, is healthy, says L2 is down, and serves from L1.
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let a = kvd_l2(&url, &["--l2-deadline-ms", "200"]);
    let b = kvd_l2(&url, &["--l2-deadline-ms", "200"]);
    wait_l2_state(&a, "down");
    let ca = a.client("a").await;
    let kv = cache(3);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let early = hashes(0, 2);
    store(&ca, &reg, &early, 0).await;
    let hit = ca.lookup(lookup(FP, &[0], &early, false, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 2, "L1 serves while L2 is down");

    // L2 comes up: kvd reconnects by itself and writes new stores behind.
    let server = RedisServer::start_on(port, &[]);
    wait_l2_state(&a, "up");
    wait_l2_state(&b, "up");
    let h2 = hashes(100, 3);
    store(&ca, &reg, &h2, 10).await;
    wait_metric(&a, WRITTEN, 3.0);
    let cb = b.client("b").await;
    let dst = cache(4);
    let reg_b = dst.register(&cb, FP, 0).await.unwrap();
    let pin = lookup_until(&b, &cb, lookup(FP, &[0], &h2, true, 1), 3).await;
    retrieve(&cb, &reg_b, pin, &h2, 40).await;
    let src: Vec<Vec<u8>> = (10..10 + 3 * PER).map(|b| kv.block_bytes(b)).collect();
    assert_same_blocks(&src, &dst, 40);

    // Slow: a stopped server answers nothing. A lookup that needs it answers from L1 after
    // the deadline instead of waiting (the bound here is generous: it catches a stall, it
    // does not measure speed).
    let h3 = hashes(200, 2);
    store(&ca, &reg, &h3, 20).await;
    wait_metric(&a, WRITTEN, 5.0);
    server.signal(Signal::STOP);
    let t = Instant::now();
    let hit = cb.lookup(lookup(FP, &[0], &h3, false, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 0);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let hit = cb.lookup(lookup(FP, &[0], &h2, false, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 3, "what B holds in L1 is still a hit");
    assert!(b.metric("kvd_l2_lookup_timeouts_total") >= 1.0 || l2_health(&b)["state"] == "down");
    server.signal(Signal::CONT);
    wait_l2_state(&b, "up");
    // Within a bound: lookups skip an L2 for a second after it failed them.
    lookup_until(&b, &cb, lookup(FP, &[0], &h3, false, 1), 2).await;

    // Full: a server at maxmemory refuses writes; stores still succeed in L1, the failed
    // writes are counted and /healthz names the cause.
    server.cmd(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
    server.cmd(&["CONFIG", "SET", "maxmemory", "1"]);
    let h4 = hashes(300, 4);
    store(&ca, &reg, &h4, 30).await;
    wait_metric(&a, r#"kvd_l2_write_behind_total{outcome="failed""#, 4.0);
    assert!(a.metric(r#"kvd_l2_errors_total{kind="full",op="set""#) >= 1.0);
    let h = l2_health(&a);
    assert!(h["last_error"].as_str().unwrap().contains("full"), "{h}");
    let hit = ca.lookup(lookup(FP, &[0], &h4, false, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 4, "L1 holds what L2 refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_node_killed_mid_run_costs_only_its_chunks() {
    let mut cluster = RedisCluster::start(3);
    let a = kvd_l2(&cluster.url(), &["--l2-deadline-ms", "2000"]);
    let b = kvd_l2(&cluster.url(), &["--l2-deadline-ms", "2000"]);
    let (ca, cb) = (a.client("a").await, b.client("b").await);
    let kv = cache(5);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let dst = cache(6);
    let reg_b = dst.register(&cb, FP, 0).await.unwrap();
    let h = hashes(0, 8);
    store(&ca, &reg, &h, 0).await;
    wait_metric(&a, WRITTEN, 8.0);

    // Kill the node holding chunk 3 (or a later one): lookups on B still answer, within the
    // deadline, with the prefix the surviving nodes hold.
    let name = |hash: u128| format!("kvd:1:{FP:016x}:{:016x}:0:{hash:032x}", 0);
    let holder = |i: usize| {
        cluster
            .nodes
            .iter()
            .position(|n| n.kvd_keys().contains(&name(h[i])))
            .unwrap()
    };
    let victim = holder(3);
    let first_lost = (0..8).find(|&i| holder(i) == victim).unwrap();
    cluster.nodes[victim].kill();
    let t = Instant::now();
    let hit = cb.lookup(lookup(FP, &[0], &h, true, 1)).await.unwrap();
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(
        hit.hit_chunks as usize, first_lost,
        "the surviving nodes serve the prefix before the first lost chunk"
    );
    if hit.hit_chunks > 0 {
        let n = hit.hit_chunks as usize;
        retrieve(&cb, &reg_b, hit.pin_id, &h[..n], 20).await;
        let src: Vec<Vec<u8>> = (0..n as u32 * PER).map(|b| kv.block_bytes(b)).collect();
        assert_same_blocks(&src, &dst, 20);
    }
    // /healthz stays 200 and says the cluster is degraded: requests to one node fail while
    // the others answer.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        cb.lookup(lookup(FP, &[0], &h, false, 1)).await.unwrap();
        if l2_health(&b)["state"] == "degraded" {
            break;
        }
        assert!(Instant::now() < deadline, "{}", l2_health(&b));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A keeps storing into L1.
    let h2 = hashes(1000, 4);
    store(&ca, &reg, &h2, 30).await;
    let hit = ca.lookup(lookup(FP, &[0], &h2, false, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 4);

    // The node comes back (empty: no persistence) and rejoins; kvd reconnects by itself and
    // new chunks round-trip through the whole cluster again.
    cluster.nodes[victim].restart();
    cluster.wait_ok(Duration::from_secs(30));
    // Writes that fail while the client finds the node again are counted and dropped, so
    // each round stores fresh chunks until one round trips whole.
    let deadline = Instant::now() + Duration::from_secs(30);
    for round in 0u32.. {
        let h3 = hashes(2000 + round * 1000, 4);
        let settled = a.metric(WRITTEN) + a.metric(r#"kvd_l2_write_behind_total{outcome="failed""#);
        store(&ca, &reg, &h3, 40 + (round % 2) * 8).await;
        let until = Instant::now() + Duration::from_secs(10);
        while a.metric(WRITTEN) + a.metric(r#"kvd_l2_write_behind_total{outcome="failed""#)
            < settled + 4.0
        {
            assert!(
                Instant::now() < until,
                "write-behind stalled; log:\n{}",
                a.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let hit = cb.lookup(lookup(FP, &[0], &h3, false, 1)).await.unwrap();
        if hit.hit_chunks == 4 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the node came back B found {} of 4 chunks; A's log:\n{}",
            hit.hit_chunks,
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_evicted_from_l1_comes_back_from_l2() {
    let server = RedisServer::start(&[]);
    // A 2 MiB pool: 512 pages of this cache's 4 KiB chunks. LRU, so that the chunks stored
    // first are the ones that leave L1 (with nothing ever read, the default `prefix-reuse`
    // keeps what it stored first and takes the newest).
    let a = kvd_l2(
        &server.url(),
        &["--l1-size-gb", "0.002", "--eviction", "lru"],
    );
    let ca = a.client("a").await;
    let kv = cache(8);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    // 20 requests of 32 chunks, all from the same blocks: 640 chunks through 512 pages.
    let requests: Vec<Vec<u128>> = (0..20).map(|r| hashes(r * 10_000, 32)).collect();
    for (r, h) in requests.iter().enumerate() {
        store(&ca, &reg, h, 0).await;
        // Written before the next request can evict them.
        wait_metric(&a, WRITTEN, (32 * (r + 1)) as f64);
    }
    assert!(a.metric("kvd_evictions_total") >= 128.0);
    assert_eq!(
        a.metric(r#"kvd_l2_write_behind_total{outcome="dropped_evicted""#),
        0.0
    );
    // The first request's chunks left L1; a lookup brings them back from L2.
    let hit = ca
        .lookup(lookup(FP, &[0], &requests[0], true, 1))
        .await
        .unwrap();
    assert_eq!(hit.hit_chunks, 32);
    assert_eq!(a.metric(r#"kvd_l2_lookup_chunks_total{result="hit""#), 32.0);
    // Retrieved into other memory, they are the bytes that were stored.
    let dst = cache(9);
    let reg_b = dst.register(&ca, FP, 0).await.unwrap();
    retrieve(&ca, &reg_b, 0, &requests[0], 0).await;
    ca.release(Release { pin_id: hit.pin_id }).await.unwrap();
    assert_same_blocks(&src, &dst, 0);
}
