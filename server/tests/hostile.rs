//! Hostile and unlucky clients against a real kvd (issue #15, issue #13 item 3): a flood on the
//! fd socket, silent ZMQ connections, a client that never reads its replies, one that pipelines
//! heavy requests, half-sent messages — kvd stays healthy, serves the others, and bounds what
//! each one costs. Sized from small limits so each runs in seconds on a 2-CPU machine.

mod common;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream as StdUnixStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use common::*;
use kvd_proto::wire::*;
use kvd_proto::zmtp::{dealer, Endpoint, Limits};

async fn raw(endpoint: &str) -> (dealer::DealerReader, dealer::DealerWriter) {
    let ep = Endpoint::parse(endpoint).unwrap();
    let (r, w, _) = dealer::connect(&ep, b"raw", Limits::default(), Duration::from_secs(10))
        .await
        .unwrap();
    (r, w)
}

fn hello() -> Bytes {
    encode_request(
        1,
        &Request::Hello(Hello {
            protocol_version: PROTOCOL_VERSION as u16,
            client: "raw".into(),
            pid: 1,
            role: Role::Tool,
        }),
    )
}

async fn said_hello(endpoint: &str) -> (dealer::DealerReader, dealer::DealerWriter) {
    let (mut r, mut w) = raw(endpoint).await;
    w.send(&[hello()]).await.unwrap();
    let reply = r.recv().await.unwrap();
    assert!(matches!(
        decode_reply(&reply[0], 1 << 20).unwrap().1,
        Reply::Hello(_)
    ));
    (r, w)
}

/// A DEALER spoken by hand over a blocking socket (greeting, READY, hello), so that a test can
/// then write raw bytes — half a frame — and stop.
fn hand_made_dealer(addr: &str) -> std::net::TcpStream {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&greeting(false)).unwrap();
    let mut ready = BytesMut::new();
    ready.put_u8(5);
    ready.put_slice(b"READY");
    ready.put_u8(11);
    ready.put_slice(b"Socket-Type");
    ready.put_u32(6);
    ready.put_slice(b"DEALER");
    s.write_all(&[0x04, ready.len() as u8]).unwrap();
    s.write_all(&ready).unwrap();
    let read_frame = |s: &mut std::net::TcpStream| {
        let mut flags = [0u8; 1];
        s.read_exact(&mut flags).unwrap();
        let len = if flags[0] & 0x02 != 0 {
            let mut l = [0u8; 8];
            s.read_exact(&mut l).unwrap();
            u64::from_be_bytes(l) as usize
        } else {
            let mut l = [0u8; 1];
            s.read_exact(&mut l).unwrap();
            l[0] as usize
        };
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).unwrap();
        body
    };
    let mut peer = [0u8; 64];
    s.read_exact(&mut peer).unwrap();
    read_frame(&mut s);
    let h = hello();
    s.write_all(&[0x00, h.len() as u8]).unwrap();
    s.write_all(&h).unwrap();
    let reply = read_frame(&mut s);
    assert!(matches!(
        decode_reply(&reply, 1 << 20).unwrap().1,
        Reply::Hello(_)
    ));
    s
}

fn until(what: &str, within: Duration, mut ok: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !ok() {
        assert!(Instant::now() < deadline, "{what} within {within:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_fd_socket_flood_cannot_starve_kvd_of_descriptors() {
    raise_open_files();
    let kvd = Kvd::start_with_open_files(&[], Some(1024));
    kvd.wait_healthy(Duration::from_secs(30));
    let pid = kvd.child.id();
    let path = kvd.fd_socket.clone();
    // Unclaimed descriptors, 253 at a time, until kvd refuses them: never past its limit.
    let stash = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || {
            let mut sent = 0;
            for token in 1..=20u128 {
                let files: Vec<OwnedFd> = (0..253)
                    .map(|_| {
                        rustix::fs::memfd_create("flood", rustix::fs::MemfdFlags::CLOEXEC).unwrap()
                    })
                    .collect();
                let borrowed: Vec<BorrowedFd<'_>> = files.iter().map(|f| f.as_fd()).collect();
                match kvd_proto::fdpass::send_fds(&path, token, &borrowed) {
                    Ok(_) => sent += 253,
                    Err(_) => break,
                }
            }
            sent
        })
        .await
        .unwrap()
    };
    assert!(stash < 20 * 253, "kvd refused descriptors before its limit");
    // Then more idle connections than kvd has descriptors.
    let idle: Vec<StdUnixStream> = (0..1500)
        .filter_map(|_| StdUnixStream::connect(&path).ok())
        .collect();
    assert!(idle.len() > 1024, "the flood got through to kvd's backlog");
    std::thread::sleep(Duration::from_millis(500));
    let held = open_fds(pid);
    assert!(held < 1024 - 100, "kvd holds {held} of 1024 descriptors");
    // kvd still answers its probes and lets a client in.
    assert_eq!(kvd.get("/healthz").0, 200);
    let c = tokio::time::timeout(Duration::from_secs(10), kvd.client("during the flood"))
        .await
        .expect("a ZMQ client gets in during the flood");
    assert!(c.ping(Ping {}).await.is_ok());
    assert!(kvd.metric("kvd_fd_socket_refusals_total") > 0.0);
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_cannot_lock_identified_clients_out() {
    raise_open_files();
    let kvd = Kvd::ready(&["--max-connections", "64", "--hello-timeout-ms", "1500"]);
    // Fill every slot with connections that finish the ZMTP handshake and never say hello.
    let mut silent = Vec::new();
    for _ in 0..64 {
        silent.push(raw(&kvd.zmq).await);
    }
    assert_eq!(kvd.metric("kvd_connections"), 64.0);
    // An identified client still gets in, in the place of the oldest silent one.
    let c = tokio::time::timeout(Duration::from_secs(5), kvd.client("newcomer"))
        .await
        .expect("a client gets in while silent connections fill the table");
    assert!(c.ping(Ping {}).await.is_ok());
    assert!(
        kvd.metric("kvd_connections_closed_total{reason=\"displaced_anonymous\"") >= 1.0,
        "{}",
        kvd.get("/metrics").1
    );
    // Silent ones are closed at the hello deadline; the identified one is kept.
    for (mut r, _w) in silent {
        let end = tokio::time::timeout(Duration::from_secs(5), r.recv()).await;
        assert!(
            matches!(end, Ok(Err(_))),
            "a silent connection was closed: {end:?}"
        );
    }
    assert!(kvd.metric("kvd_connections_closed_total{reason=\"no_hello\"") >= 60.0);
    assert!(c.ping(Ping {}).await.is_ok());
    assert_eq!(kvd.metric("kvd_connections"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_its_replies_is_closed_and_its_descriptor_freed() {
    let dir = TempDir::new("stuck");
    let ipc = dir.0.join("kvd.sock");
    let ipc_s = ipc.display().to_string();
    let kvd = Kvd::ready(&["--ipc", &ipc_s]);
    let pid = kvd.child.id();
    let endpoint = format!("ipc://{ipc_s}");
    let before = open_fds(pid);
    // Ten clients pipeline pings and never read a reply.
    let mut stuck = Vec::new();
    for _ in 0..10 {
        let (r, mut w) = said_hello(&endpoint).await;
        let ping = encode_request(2, &Request::Ping(Ping {}));
        let batch: Vec<Bytes> = vec![ping; 1];
        // Until kvd stops reading (its reply queue and the socket are full) and closes.
        let _ = tokio::time::timeout(Duration::from_secs(20), async {
            for _ in 0..100_000 {
                if w.send(&batch).await.is_err() {
                    break;
                }
            }
        })
        .await;
        stuck.push((r, w));
    }
    until(
        "kvd closes every client that stopped reading",
        Duration::from_secs(10),
        || open_fds(pid) <= before,
    );
    assert_eq!(kvd.get("/healthz").0, 200);
    assert!(kvd.metric("kvd_connections_closed_total{reason=\"not_reading\"") >= 10.0);
    let c = kvd.client("reader").await;
    assert!(c.ping(Ping {}).await.is_ok());
    drop(stuck);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pipelining_heavy_lookups_leaves_others_their_share() {
    let kvd = Kvd::ready(&[]);
    let (mut r, mut w) = said_hello(&kvd.zmq).await;
    let answered = Arc::new(AtomicUsize::new(0));
    let counter = answered.clone();
    let reader = tokio::spawn(async move {
        for _ in 0..300 {
            if r.recv().await.is_err() {
                break;
            }
            counter.fetch_add(1, Ordering::SeqCst);
        }
    });
    // 300 lookups of the most chunks a request may name, encoded first, then sent without
    // waiting.
    let frames: Vec<Vec<Bytes>> = (0..300u64)
        .map(|i| {
            vec![encode_request(
                100 + i,
                &Request::Lookup(Lookup {
                    fingerprint: 1,
                    salt: 0,
                    shards: vec![0],
                    hashes: (0..16_384u128).map(|h| h + (i as u128) * 16_384).collect(),
                    pin: false,
                    readers: 1,
                    held: 0,
                }),
            )]
        })
        .collect();
    let writer = tokio::spawn(async move {
        w.send_many(&frames).await.unwrap();
        w
    });
    let light = kvd.client("light").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while answered.load(Ordering::SeqCst) < 5 {
        assert!(Instant::now() < deadline, "heavy lookups are answered");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // While the heavy client still has hundreds queued, a ping waits behind at most its
    // in-flight share (--max-in-flight, 8), not behind everything it sent.
    let mut overtaken = Vec::new();
    for _ in 0..5 {
        let a = answered.load(Ordering::SeqCst);
        light.ping(Ping {}).await.unwrap();
        let b = answered.load(Ordering::SeqCst);
        if b >= 300 {
            break;
        }
        overtaken.push(b - a);
    }
    assert!(
        !overtaken.is_empty(),
        "a ping waited until every heavy lookup was answered"
    );
    let worst = *overtaken.iter().max().unwrap();
    assert!(
        worst <= 40,
        "a ping waited behind {worst} heavy lookups ({overtaken:?})"
    );
    reader.await.unwrap();
    drop(writer.await.unwrap());
    assert_eq!(
        answered.load(Ordering::SeqCst),
        300,
        "every lookup answered"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_messages_cannot_grow_kvd_past_its_buffer_budget() {
    let kvd = Kvd::ready(&["--max-frame-mb", "1", "--max-buffered-mb", "8"]);
    let addr = kvd.zmq.trim_start_matches("tcp://").to_string();
    // Eight connections each declare a 1 MiB frame, send most of it, and stall: the budget is
    // spent.
    let mut stalled = Vec::new();
    for _ in 0..8 {
        use std::io::Write;
        let mut s = hand_made_dealer(&addr);
        let mut head = BytesMut::new();
        head.put_u8(0x02);
        head.put_u64(1 << 20);
        head.put_slice(&encode_request(3, &Request::Ping(Ping {})));
        head.resize(900 * 1024, 0);
        s.write_all(&head).unwrap();
        stalled.push(s);
    }
    std::thread::sleep(Duration::from_millis(300));
    // A whole 1 MiB request now finds no budget: refused unread with Busy, connection kept.
    let (mut r, mut w) = said_hello(&kvd.zmq).await;
    let mut big = BytesMut::from(&encode_request(44, &Request::Ping(Ping {}))[..]);
    big.resize(1 << 20, 0);
    w.send(&[big.freeze()]).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), r.recv())
        .await
        .unwrap()
        .unwrap();
    match decode_reply(&reply[0], 1 << 20).unwrap() {
        (44, Reply::Error(e)) => {
            assert_eq!(e.code, ErrorCode::Busy, "{}", e.message);
            assert!(e.message.contains("--max-buffered-mb"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
    // Parts that each fit but add up past the frame limit are refused too, unbuffered.
    let parts: Vec<Bytes> = (0..4).map(|_| Bytes::from(vec![0u8; 600 * 1024])).collect();
    drop(stalled);
    std::thread::sleep(Duration::from_millis(300));
    w.send(&parts).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), r.recv())
        .await
        .unwrap()
        .unwrap();
    match decode_reply(&reply[0], 1 << 20).unwrap().1 {
        Reply::Error(e) => assert!(e.message.contains("--max-frame-mb"), "{}", e.message),
        other => panic!("{other:?}"),
    }
    // Nine small parts: named as such, not as an oversized frame.
    let nine: Vec<Bytes> = (0..9)
        .map(|_| encode_request(45, &Request::Ping(Ping {})))
        .collect();
    w.send(&nine).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(10), r.recv())
        .await
        .unwrap()
        .unwrap();
    match decode_reply(&reply[0], 1 << 20).unwrap() {
        (45, Reply::Error(e)) => {
            assert!(
                e.message.contains("9 parts; send one frame per request"),
                "{}",
                e.message
            )
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(kvd.get("/healthz").0, 200);
}

fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .unwrap();
    kib / 1024
}

#[test]
fn unfinished_multipart_messages_are_not_buffered_past_one_frame() {
    use std::io::Write;
    raise_open_files();
    let kvd = Kvd::ready(&["--max-frame-mb", "1"]);
    let pid = kvd.child.id();
    let before = rss_mib(pid);
    let addr = kvd.zmq.trim_start_matches("tcp://").to_string();
    // 64 connections each send 7 parts of just under 1 MiB and never the last part: 448 MiB
    // that kvd used to hold (it allowed 8 parts of --max-frame-mb each per connection).
    let mut conns = Vec::new();
    for _ in 0..64 {
        let mut s = hand_made_dealer(&addr);
        let part = vec![1u8; (1 << 20) - 1];
        for _ in 0..7 {
            s.write_all(&[0x03]).unwrap();
            s.write_all(&(part.len() as u64).to_be_bytes()).unwrap();
            s.write_all(&part).unwrap();
        }
        conns.push(s);
    }
    std::thread::sleep(Duration::from_millis(1000));
    let grew = rss_mib(pid).saturating_sub(before);
    assert!(
        grew < 160,
        "kvd grew by {grew} MiB holding unfinished messages"
    );
    assert_eq!(kvd.get("/healthz").0, 200);
    drop(conns);
}

#[test]
fn an_idle_kvd_exports_every_metric_the_docs_list() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/operations.md");
    let doc = std::fs::read_to_string(path).expect(path);
    let section = doc
        .split("## Health and metrics")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        // The L2 tier's families exist only with --l2, as the docs say there.
        .and_then(|s| s.split("With `--l2`").next())
        .expect("a metrics section");
    // Each `kvd_name` or `kvd_name{label}` the docs name.
    let mut listed = Vec::new();
    for piece in section.split('`').skip(1).step_by(2) {
        if let Some(name) = piece.strip_prefix("kvd_") {
            let (name, label) = match name.split_once('{') {
                // `{op,code}`: every series carries the first label too.
                Some((n, l)) => (
                    n,
                    l.trim_end_matches('}')
                        .split(',')
                        .next()
                        .map(str::to_string),
                ),
                None => (name, None),
            };
            listed.push((format!("kvd_{name}"), label));
        }
    }
    assert!(listed.len() > 20, "{listed:?}");
    let kvd = Kvd::ready(&[]);
    let (_, body) = kvd.get("/metrics");
    for (name, label) in listed {
        let series: Vec<&str> = body
            .lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                l.strip_prefix(name.as_str())
                    .is_some_and(|r| r.starts_with([' ', '{', '_']))
            })
            .collect();
        assert!(!series.is_empty(), "{name} is missing on an idle kvd");
        if let Some(label) = label {
            assert!(
                series.iter().any(|l| l.contains(&format!("{label}=\""))),
                "{name} has no {label} series on an idle kvd"
            );
        }
    }
}

#[test]
fn slow_http_clients_cannot_hold_kvd_descriptors_or_keep_probes_out() {
    use std::io::Write;
    raise_open_files();
    let kvd = Kvd::ready(&[]);
    let pid = kvd.child.id();
    let before = open_fds(pid);
    // 300 clients that send half a request head and stall.
    let slow: Vec<std::net::TcpStream> = (0..300)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(kvd.http).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: k").unwrap();
            s
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let held = open_fds(pid).saturating_sub(before);
    assert!(
        held <= 64 + 8,
        "kvd holds {held} descriptors for slow HTTP clients"
    );
    assert_eq!(kvd.get("/healthz").0, 200, "probes still get in");
    drop(slow);
}
