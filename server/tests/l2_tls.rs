//! TLS to the L2 against a real `redis-server` with TLS enabled (Debian's build has it): one
//! server over `rediss://` and a cluster over `rediss+cluster://`, the servers' certificates
//! checked against `--l2-ca-file`. The certificates are made here, at test time, by `openssl`
//! (a throwaway CA valid for a day; nothing secret is committed).

mod common;

use std::path::Path;
use std::process::Command;

use common::l2::*;
use common::redis_servers::{free_port, RedisCluster, RedisServer};
use common::*;

/// A CA and a certificate it signed for 127.0.0.1 and localhost.
struct Certs {
    _dir: TempDir,
    ca: String,
    cert: String,
    key: String,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!("the TLS tests make certificates with openssl ({e}): apt-get install openssl — scripts/test.sh does")
        });
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn certs() -> Certs {
    let dir = TempDir::new("tls");
    let d = &dir.0;
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec!["req", "-x509", "-days", "1", "-subj", "/CN=kvd test CA"];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.crt"]);
    openssl(d, &ca);
    let mut csr = vec!["req", "-subj", "/CN=localhost"];
    csr.extend(ec);
    csr.extend(["-keyout", "server.key", "-out", "server.csr"]);
    openssl(d, &csr);
    std::fs::write(
        d.join("ext"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n\
         keyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\n",
    )
    .unwrap();
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            "ext",
            "-out",
            "server.crt",
        ],
    );
    let p = |f: &str| d.join(f).display().to_string();
    Certs {
        ca: p("ca.crt"),
        cert: p("server.crt"),
        key: p("server.key"),
        _dir: dir,
    }
}

/// Settings that add a TLS port to a server (its plain port stays, for the harness only).
fn tls_args(c: &Certs, tls_port: u16) -> Vec<String> {
    [
        "--tls-port",
        &tls_port.to_string(),
        "--tls-cert-file",
        &c.cert,
        "--tls-key-file",
        &c.key,
        "--tls-ca-cert-file",
        &c.ca,
        "--tls-auth-clients",
        "no",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_reaches_a_tls_server_and_checks_its_certificate() {
    let c = certs();
    let tls_port = free_port();
    let args = tls_args(&c, tls_port);
    let server = RedisServer::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let url = format!("rediss://127.0.0.1:{tls_port}");

    let a = kvd_l2(&url, &["--l2-ca-file", &c.ca]);
    let b = kvd_l2(&url, &["--l2-ca-file", &c.ca]);
    assert_eq!(wait_l2_state(&a, "up")["url"], url);
    assert!(a.log().contains("over TLS"), "{}", a.log());
    let (ca, cb) = (a.client("a").await, b.client("b").await);
    let (src, dst) = (cache(1), cache(2));
    let reg_a = src.register(&ca, FP, 0).await.unwrap();
    let reg_b = dst.register(&cb, FP, 0).await.unwrap();
    let h = hashes(0, 6);
    store(&ca, &reg_a, &h, 0).await;
    wait_metric(&a, WRITTEN, 6.0);
    assert_eq!(server.kvd_keys().len(), 6, "written through the TLS port");
    let hit = cb.lookup(lookup(FP, &[0], &h, true, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 6, "{}", b.log());
    retrieve(&cb, &reg_b, hit.pin_id, &h, 20).await;
    let want: Vec<Vec<u8>> = (0..6 * PER).map(|i| src.block_bytes(i)).collect();
    assert_same_blocks(&want, &dst, 20);

    // Without the CA the server's certificate is not trusted; plain text to a TLS port is
    // not answered either. Both leave L2 down with a reason, and kvd healthy.
    let untrusted = kvd_l2(&url, &[]);
    let h = wait_l2_state(&untrusted, "down");
    let why = h["last_error"].as_str().unwrap().to_lowercase();
    assert!(why.contains("certificate") || why.contains("issuer"), "{h}");
    let plain = kvd_l2(&format!("redis://127.0.0.1:{tls_port}"), &[]);
    wait_l2_state(&plain, "down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_cluster_spreads_chunks_over_every_tls_node() {
    let c = certs();
    let tls_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let extra: Vec<Vec<String>> = tls_ports
        .iter()
        .map(|&p| {
            let mut a = tls_args(&c, p);
            // The cluster bus over TLS too, so that the nodes announce their TLS ports.
            a.extend(["--tls-cluster", "yes"].map(String::from));
            a
        })
        .collect();
    let cluster = RedisCluster::start_with(&extra);
    let nodes: Vec<String> = tls_ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let url = format!("rediss+cluster://{}", nodes.join(","));

    let a = kvd_l2(&url, &["--l2-ca-file", &c.ca]);
    let b = kvd_l2(&url, &["--l2-ca-file", &c.ca]);
    wait_l2_state(&a, "up");
    let (ca, cb) = (a.client("a").await, b.client("b").await);
    let (src, dst) = (cache(3), cache(4));
    let reg_a = src.register(&ca, FP, 0).await.unwrap();
    let reg_b = dst.register(&cb, FP, 0).await.unwrap();
    let h = hashes(0, 12);
    store(&ca, &reg_a, &h, 0).await;
    wait_metric(&a, WRITTEN, 12.0);
    for node in &cluster.nodes {
        assert!(!node.kvd_keys().is_empty(), "every node holds some chunks");
    }
    let hit = cb.lookup(lookup(FP, &[0], &h, true, 1)).await.unwrap();
    assert_eq!(hit.hit_chunks, 12, "{}", b.log());
    retrieve(&cb, &reg_b, hit.pin_id, &h, 30).await;
    let want: Vec<Vec<u8>> = (0..12 * PER).map(|i| src.block_bytes(i)).collect();
    assert_same_blocks(&want, &dst, 30);
}
