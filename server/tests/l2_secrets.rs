//! The L2's secrets against real Redis servers: the password never shows (in `/healthz`, the
//! log or the process's argv) whichever way it comes in; an ACL user limited to kvd's keys is
//! all kvd needs (docs/security.md's rule, as written there); values not MAC'd with the nodes'
//! shared secret are rejected; and every L2 metric series exists from the start.

mod common;

use common::l2::*;
use common::redis_servers::{free_port, RedisCluster, RedisServer};
use common::*;

const PASSWORD: &str = "hunter2-S3CRET-pw";

/// The ACL rule docs/security.md gives for kvd's user, with its password appended.
pub const KVD_ACL: &str = "on resetkeys ~kvd:* resetchannels -@all +get +set +ping +cluster|slots";

fn write(dir: &TempDir, name: &str, bytes: &[u8]) -> String {
    let p = dir.0.join(name);
    std::fs::write(&p, bytes).unwrap();
    p.display().to_string()
}

fn assert_hidden(kvd: &Kvd, secret: &str) {
    let (_, body) = kvd.get("/healthz");
    assert!(
        !body.contains(secret),
        "/healthz shows the password: {body}"
    );
    let (_, metrics) = kvd.get("/metrics");
    assert!(!metrics.contains(secret), "/metrics shows the password");
    assert!(
        !kvd.log().contains(secret),
        "the log shows the password:\n{}",
        kvd.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_l2_password_never_shows_whichever_way_it_comes_in() {
    let server = RedisServer::start(&["--requirepass", PASSWORD]);
    let dir = TempDir::new("pw");
    let pw_file = write(&dir, "l2.password", format!("{PASSWORD}\n").as_bytes());
    let hostport = format!("127.0.0.1:{}", server.port);

    // In the URL: it works, is redacted everywhere kvd shows it, and kvd warns about argv.
    let url = format!("redis://:{PASSWORD}@{hostport}");
    let a = kvd_l2(&url, &[]);
    let h = wait_l2_state(&a, "up");
    assert_eq!(h["url"], format!("redis://:***@{hostport}"));
    assert_hidden(&a, PASSWORD);
    assert!(a.log().contains("--l2-password-file"), "{}", a.log());

    // From a file: not in argv either, and the chunks go through.
    let b = kvd_l2(
        &format!("redis://{hostport}"),
        &["--l2-password-file", &pw_file],
    );
    wait_l2_state(&b, "up");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", b.child.id())).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains(PASSWORD));
    assert_hidden(&b, PASSWORD);
    let client = b.client("w").await;
    let kv = cache(3);
    let reg = kv.register(&client, FP, 0).await.unwrap();
    store(&client, &reg, &hashes(0, 2), 0).await;
    wait_metric(&b, WRITTEN, 2.0);
    assert_eq!(server.kvd_keys().len(), 2);

    // From the environment.
    let c = Kvd::start_env(
        &[
            "--chunk-tokens",
            "32",
            "--l2",
            &format!("redis://{hostport}"),
        ],
        &[("KVD_L2_PASSWORD", PASSWORD)],
    );
    c.wait_healthy(std::time::Duration::from_secs(30));
    wait_l2_state(&c, "up");
    assert_hidden(&c, PASSWORD);

    // A wrong one: L2 is down, the reason says why, and neither password shows.
    let wrong = write(&dir, "wrong", b"not-the-password-9");
    let d = kvd_l2(
        &format!("redis://{hostport}"),
        &["--l2-password-file", &wrong],
    );
    let h = wait_l2_state(&d, "down");
    let why = h["last_error"].as_str().unwrap().to_lowercase();
    assert!(why.contains("pass") || why.contains("auth"), "{h}");
    assert_hidden(&d, "not-the-password-9");
}

/// Makes `user` on `server` with docs/security.md's rule.
fn acl_user(server: &RedisServer, user: &str, password: &str) {
    let mut args = vec!["ACL", "SETUSER", user];
    args.extend(KVD_ACL.split_whitespace());
    let pw = format!(">{password}");
    args.push(&pw);
    server.cmd(&args);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acl_user_limited_to_kvd_keys_serves_one_server_and_a_cluster() {
    let dir = TempDir::new("acl");
    let pw_file = write(&dir, "pw", b"kvd-only-pw-123\n");
    let server = RedisServer::start(&[]);
    acl_user(&server, "kvd", "kvd-only-pw-123");
    // The rule is narrow: that user reads no other key.
    let mut c = redis::Client::open(format!(
        "redis://kvd:kvd-only-pw-123@127.0.0.1:{}",
        server.port
    ))
    .unwrap()
    .get_connection()
    .unwrap();
    let denied: redis::RedisResult<Option<String>> = redis::cmd("GET").arg("other").query(&mut c);
    assert!(denied.is_err(), "the ACL lets kvd's user read other keys");
    let denied: redis::RedisResult<()> = redis::cmd("FLUSHALL").query(&mut c);
    assert!(denied.is_err(), "the ACL lets kvd's user flush");

    let cluster = RedisCluster::start(3);
    for node in &cluster.nodes {
        acl_user(node, "kvd", "kvd-only-pw-123");
    }
    let cluster_url = cluster
        .url()
        .replace("redis+cluster://", "redis+cluster://kvd@");
    for url in [
        format!("redis://kvd@127.0.0.1:{}", server.port),
        cluster_url,
    ] {
        let a = kvd_l2(&url, &["--l2-password-file", &pw_file]);
        let b = kvd_l2(&url, &["--l2-password-file", &pw_file]);
        let h = wait_l2_state(&a, "up");
        assert!(h["url"].as_str().unwrap().contains("kvd:***@"), "{h}");
        let (ca, cb) = (a.client("a").await, b.client("b").await);
        let (src, dst) = (cache(5), cache(6));
        let reg_a = src.register(&ca, FP, 0).await.unwrap();
        let reg_b = dst.register(&cb, FP, 0).await.unwrap();
        let h = hashes(100, 4);
        store(&ca, &reg_a, &h, 0).await;
        wait_metric(&a, WRITTEN, 4.0);
        let hit = cb.lookup(lookup(FP, &[0], &h, true, 1)).await.unwrap();
        assert_eq!(hit.hit_chunks, 4, "{url}: {}", b.log());
        retrieve(&cb, &reg_b, hit.pin_id, &h, 20).await;
        let want: Vec<Vec<u8>> = (0..4 * PER).map(|i| src.block_bytes(i)).collect();
        assert_same_blocks(&want, &dst, 20);
        assert_eq!(a.metric("kvd_l2_errors_total"), 0.0, "{url}: {}", a.log());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_not_macd_with_the_nodes_secret_are_rejected() {
    let server = RedisServer::start(&[]);
    let dir = TempDir::new("mac");
    let key = write(&dir, "key", b"0f1e2d3c4b5a69788796a5b4c3d2e1f0\n");
    let other = write(&dir, "other", b"another-secret-of-enough-bytes\n");
    let url = server.url();
    let h = hashes(0, 4);
    let want = |kv: &HostKv| -> Vec<Vec<u8>> { (0..4 * PER).map(|i| kv.block_bytes(i)).collect() };

    let a = kvd_l2(&url, &["--l2-secret-file", &key]);
    assert!(
        a.log().contains("MAC'd with --l2-secret-file"),
        "{}",
        a.log()
    );
    let ca = a.client("a").await;
    let src = cache(1);
    let reg = src.register(&ca, FP, 0).await.unwrap();
    store(&ca, &reg, &h, 0).await;
    wait_metric(&a, WRITTEN, 4.0);

    // A node with the same secret reads them bit-exact.
    let b = kvd_l2(&url, &["--l2-secret-file", &key]);
    let cb = b.client("b").await;
    let dst = cache(2);
    let reg_b = dst.register(&cb, FP, 0).await.unwrap();
    let hit = cb.lookup(lookup(FP, &[0], &h, true, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 4, "{}", b.log());
    retrieve(&cb, &reg_b, hit.pin_id, &h, 20).await;
    assert_same_blocks(&want(&src), &dst, 20);

    // Another secret, or none: nothing is used, each counted by its reason.
    for (flags, reason) in [
        (vec!["--l2-secret-file", other.as_str()], "forged"),
        (vec![], "needs_secret"),
    ] {
        let k = kvd_l2(&url, &flags);
        let c = k.client("c").await;
        let kv = cache(3);
        kv.register(&c, FP, 0).await.unwrap();
        let hit = c.lookup(lookup(FP, &[0], &h, false, 1)).await.unwrap();
        assert_eq!(hit.hit_chunks, 0, "{reason}");
        assert_eq!(
            k.metric(&format!(
                "kvd_l2_rejected_values_total{{reason=\"{reason}\""
            )),
            1.0,
            "{reason}: the first chunk is rejected and the rest are not fetched into L1"
        );
        assert_eq!(k.metric("kvd_pool_chunks"), 0.0);
    }

    // Someone who can write to Redis, without the secret: a kvd of their own overwrites the
    // values with other KV under the same keys (valid checksums, no MAC), or they flip payload
    // bytes of a genuine value. The keyed nodes use neither.
    let name = |hash: u128| format!("kvd:1:{FP:016x}:{:016x}:0:{hash:032x}", 0);
    let forger = kvd_l2(&url, &[]);
    let cf = forger.client("forger").await;
    let fake = cache(66);
    let reg_f = fake.register(&cf, FP, 0).await.unwrap();
    store(&cf, &reg_f, &h[..2], 0).await;
    wait_metric(&forger, WRITTEN, 2.0);
    let mut v = server.get(&name(h[2])).unwrap();
    let at = v.len() - 7;
    v[at] ^= 0x40;
    server.set(&name(h[2]), &v);

    let e = kvd_l2(&url, &["--l2-secret-file", &key]);
    let ce = e.client("e").await;
    let kv = cache(4);
    kv.register(&ce, FP, 0).await.unwrap();
    for (i, reason) in [(0, "unauthenticated"), (2, "forged")] {
        let hit = ce
            .lookup(lookup(FP, &[0], &h[i..=i], false, 1))
            .await
            .unwrap();
        assert_eq!(hit.hit_chunks, 0, "chunk {i}: {reason}");
        assert_eq!(
            e.metric(&format!(
                "kvd_l2_rejected_values_total{{reason=\"{reason}\""
            )),
            1.0
        );
    }
    // The untouched genuine one still comes through.
    let hit = ce
        .lookup(lookup(FP, &[0], &h[3..], false, 1))
        .await
        .unwrap();
    assert_eq!(hit.hit_chunks, 1);
}

#[test]
fn every_l2_metric_series_is_exported_at_zero_from_the_start() {
    // L2 unreachable and nothing done: every family and label is there all the same.
    let kvd = Kvd::ready(&["--l2", &format!("redis://127.0.0.1:{}", free_port())]);
    let (_, body) = kvd.get("/metrics");
    let mut want: Vec<String> = vec![
        "kvd_l2_up".into(),
        "kvd_l2_lookup_timeouts_total".into(),
        "kvd_l2_write_behind_queued_total".into(),
        "kvd_l2_fetch_duration_seconds_count".into(),
    ];
    let labelled = |name: &str, key: &str, values: &[&str]| -> Vec<String> {
        values
            .iter()
            .map(|v| format!("{name}{{{key}=\"{v}\"}}"))
            .collect()
    };
    want.extend(labelled(
        "kvd_l2_lookup_chunks_total",
        "result",
        &["hit", "miss"],
    ));
    want.extend(labelled(
        "kvd_l2_bytes_total",
        "direction",
        &["read", "write"],
    ));
    want.extend(labelled(
        "kvd_l2_write_behind_total",
        "outcome",
        &["written", "dropped_queue_full", "dropped_evicted", "failed"],
    ));
    want.extend(labelled(
        "kvd_l2_rejected_values_total",
        "reason",
        &[
            "truncated",
            "version",
            "foreign",
            "length",
            "corrupt",
            "unauthenticated",
            "forged",
            "needs_secret",
        ],
    ));
    want.extend(labelled(
        "kvd_l2_fill_chunks_total",
        "outcome",
        &["filled", "present", "refused_pool_full"],
    ));
    let mut missing: Vec<String> = want
        .into_iter()
        .filter(|w| !body.lines().any(|l| l.starts_with(&format!("{w} "))))
        .collect();
    for op in ["get", "set"] {
        for kind in ["unavailable", "full", "failed"] {
            let (op_l, kind_l) = (format!("op=\"{op}\""), format!("kind=\"{kind}\""));
            if !body.lines().any(|l| {
                l.starts_with("kvd_l2_errors_total{") && l.contains(&op_l) && l.contains(&kind_l)
            }) {
                missing.push(format!("kvd_l2_errors_total{{{op_l},{kind_l}}}"));
            }
        }
    }
    assert!(missing.is_empty(), "absent at start: {missing:?}");
}
