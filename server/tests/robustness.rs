//! Bad input gets a clear, typed error reply and loses nothing: malformed frames, wrong
//! protocol versions, requests before hello, oversized frames, non-ZMTP garbage — while
//! `/healthz` stays 200 and other clients are served.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use common::*;
use kvd_proto::wire::*;
use kvd_proto::zmtp::{dealer, Endpoint, Limits};

async fn raw(kvd: &Kvd) -> (dealer::DealerReader, dealer::DealerWriter) {
    let ep = Endpoint::parse(&kvd.zmq).unwrap();
    let (r, w, _) = dealer::connect(&ep, b"raw", Limits::default(), Duration::from_secs(5))
        .await
        .unwrap();
    (r, w)
}

async fn exchange(
    r: &mut dealer::DealerReader,
    w: &mut dealer::DealerWriter,
    parts: Vec<Bytes>,
) -> (u64, Reply) {
    w.send(&parts).await.unwrap();
    let reply = tokio::time::timeout(Duration::from_secs(5), r.recv())
        .await
        .expect("a reply")
        .unwrap();
    decode_reply(&reply[0], 64 << 20).expect("a decodable reply")
}

fn expect_error(reply: Reply, code: ErrorCode, needle: &str) {
    match reply {
        Reply::Error(e) => {
            assert_eq!(e.code, code, "{}", e.message);
            assert!(
                e.message.contains(needle),
                "{:?} lacks {needle:?}",
                e.message
            );
        }
        other => panic!("expected {code:?}, got {other:?}"),
    }
}

fn hello(version: u16) -> Bytes {
    encode_request(
        1,
        &Request::Hello(Hello {
            protocol_version: version,
            client: "raw".into(),
            pid: 1,
            role: Role::Tool,
        }),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_get_error_replies_and_nothing_breaks() {
    let kvd = Kvd::ready(&["--max-frame-mb", "1"]);
    let good = kvd.client("good").await;
    let (mut r, mut w) = raw(&kvd).await;

    // Before hello.
    let (id, reply) = exchange(
        &mut r,
        &mut w,
        vec![encode_request(5, &Request::Ping(Ping {}))],
    )
    .await;
    assert_eq!(id, 5);
    expect_error(reply, ErrorCode::HelloRequired, "send hello");

    // Wrong protocol version in the hello body.
    let (_, reply) = exchange(&mut r, &mut w, vec![hello(9)]).await;
    expect_error(reply, ErrorCode::VersionMismatch, "protocol 9");
    // Wrong version byte in the frame header: the request id still comes back.
    let mut v2 = encode_request(77, &Request::Ping(Ping {})).to_vec();
    v2[2] = PROTOCOL_VERSION + 1;
    let (id, reply) = exchange(&mut r, &mut w, vec![Bytes::from(v2)]).await;
    assert_eq!(id, 77);
    expect_error(
        reply,
        ErrorCode::VersionMismatch,
        &format!("speaks {PROTOCOL_VERSION}"),
    );

    let (_, reply) = exchange(&mut r, &mut w, vec![hello(PROTOCOL_VERSION as u16)]).await;
    assert!(matches!(reply, Reply::Hello(_)));

    // Not our magic.
    let (id, reply) = exchange(
        &mut r,
        &mut w,
        vec![Bytes::from_static(b"GET / HTTP/1.1\r\n\r\n")],
    )
    .await;
    assert_eq!(id, 0);
    expect_error(reply, ErrorCode::Malformed, "magic");
    // Unknown kind.
    let mut unknown = BytesMut::new();
    unknown.put_slice(b"KV");
    unknown.put_u8(PROTOCOL_VERSION);
    unknown.put_u8(0x42);
    unknown.put_u64_le(9);
    let (id, reply) = exchange(&mut r, &mut w, vec![unknown.freeze()]).await;
    assert_eq!(id, 9);
    expect_error(reply, ErrorCode::Malformed, "unknown message kind");
    // Truncated body: a lookup cut short.
    let full = encode_request(
        10,
        &Request::Lookup(Lookup {
            fingerprint: 1,
            salt: 0,
            shards: vec![0],
            hashes: vec![1, 2, 3],
            pin: false,
            readers: 1,
            held: 0,
        }),
    );
    let (id, reply) = exchange(&mut r, &mut w, vec![full.slice(..full.len() - 5)]).await;
    assert_eq!(id, 10);
    expect_error(reply, ErrorCode::Malformed, "truncated");
    // A hostile list length.
    let mut hostile = BytesMut::from(
        &encode_request(
            11,
            &Request::Lookup(Lookup {
                fingerprint: 1,
                salt: 0,
                shards: vec![],
                hashes: vec![],
                pin: false,
                readers: 1,
                held: 0,
            }),
        )[..],
    );
    let n = hostile.len();
    hostile[n - 12..n - 8].copy_from_slice(&u32::MAX.to_le_bytes());
    let (id, reply) = exchange(&mut r, &mut w, vec![hostile.freeze()]).await;
    assert_eq!(id, 11);
    expect_error(reply, ErrorCode::Malformed, "exceeds the limit");
    // Two parts.
    let (_, reply) = exchange(
        &mut r,
        &mut w,
        vec![
            encode_request(12, &Request::Ping(Ping {})),
            Bytes::from_static(b"x"),
        ],
    )
    .await;
    expect_error(reply, ErrorCode::Malformed, "one frame per request");
    // A frame over --max-frame-mb: skipped unread, answered, connection kept.
    let mut big = BytesMut::from(&encode_request(13, &Request::Ping(Ping {}))[..]);
    big.resize(3 << 20, 0);
    let (id, reply) = exchange(&mut r, &mut w, vec![big.freeze()]).await;
    assert_eq!(id, 13);
    expect_error(reply, ErrorCode::Malformed, "--max-frame-mb");
    // An empty lookup is a valid request with a clear refusal.
    let (_, reply) = exchange(
        &mut r,
        &mut w,
        vec![encode_request(
            14,
            &Request::Lookup(Lookup {
                fingerprint: 1,
                salt: 0,
                shards: vec![],
                hashes: vec![],
                pin: false,
                readers: 1,
                held: 0,
            }),
        )],
    )
    .await;
    expect_error(reply, ErrorCode::InvalidArgument, "at least one shard");
    // The same connection still works.
    let (id, reply) = exchange(
        &mut r,
        &mut w,
        vec![encode_request(15, &Request::Ping(Ping {}))],
    )
    .await;
    assert_eq!(id, 15);
    assert!(matches!(reply, Reply::Pong(_)));

    assert_eq!(kvd.get("/healthz").0, 200);
    assert!(
        good.ping(Ping {}).await.is_ok(),
        "other clients are unaffected"
    );
    assert_eq!(kvd.metric("kvd_malformed_frames_total"), 7.0);
    assert_eq!(
        kvd.metric("kvd_malformed_frames_total{reason=\"too_large\""),
        1.0
    );
}

/// Waits until a metric reaches `want`.
fn wait_for_metric(kvd: &Kvd, prefix: &str, want: f64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while kvd.metric(prefix) < want {
        assert!(
            std::time::Instant::now() < deadline,
            "{prefix} stayed at {}, wanted {want}; log:\n{}",
            kvd.metric(prefix),
            kvd.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends an HTTP request to kvd's ZMQ port (a scraper pointed at the wrong port) and waits
/// until kvd closes the connection; returns the client's address.
fn http_to_the_zmq_port(addr: std::net::SocketAddr) -> std::net::SocketAddr {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = Vec::new();
    let _ = s.read_to_end(&mut buf);
    s.local_addr().unwrap()
}

#[test]
fn garbage_connections_are_dropped_without_harm() {
    let kvd = Kvd::ready(&[]);
    let addr: std::net::SocketAddr = kvd.zmq.trim_start_matches("tcp://").parse().unwrap();
    const NOT_ZMTP: &str = "kvd_connections_closed_total{reason=\"not_zmtp\"";
    // Not ZMTP at all: counted, and one info line names the peer and what it sent (issue #35).
    let first = http_to_the_zmq_port(addr);
    wait_for_metric(&kvd, NOT_ZMTP, 1.0);
    let log = kvd.log();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("refused a ZMQ connection"))
        .collect();
    assert_eq!(lines.len(), 1, "{log}");
    assert!(
        lines[0].contains(" INFO ")
            && lines[0].contains(&format!("from {first}:"))
            && lines[0].contains(r#"it sent "GET / HTTP/""#)
            && lines[0].contains("--http-port"),
        "{}",
        lines[0]
    );
    // A scraper retrying does not flood the log: counted, not logged, within the minute.
    for _ in 0..5 {
        http_to_the_zmq_port(addr);
    }
    wait_for_metric(&kvd, NOT_ZMTP, 6.0);
    // A ZMTP greeting followed by a frame that declares a terabyte (what aborts servers built on
    // the zeromq crate 0.7), then silence.
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(&greeting(false)).unwrap();
    s.write_all(&[0x06]).unwrap();
    s.write_all(&(1u64 << 40).to_be_bytes()).unwrap();
    s.write_all(&[0u8; 100]).unwrap();
    drop(s);
    // Connections that never finish a handshake time out instead of piling up.
    let idle: Vec<_> = (0..20)
        .map(|_| std::net::TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(kvd.get("/healthz").0, 200);
    drop(idle);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let c = kvd.client("after").await;
        assert!(c.ping(Ping {}).await.is_ok());
    });
    assert_eq!(
        kvd.log().matches("refused a ZMQ connection").count(),
        1,
        "one line a minute: {}",
        kvd.log()
    );
    assert_eq!(
        kvd.metric(NOT_ZMTP),
        6.0,
        "connections that merely closed are not counted"
    );
}
