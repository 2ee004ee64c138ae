//! Start, readiness, flags, timeouts and shutdown of the real binary.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use kvd_proto::client::{Client, ClientConfig};
use kvd_proto::wire::*;

/// Runs kvd with `args` to completion; returns its exit code and stderr.
fn run(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(kvd_bin());
    cmd.args(args)
        .env_remove("TOTAL_CPU_DRAM_GB")
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_flags_exit_non_zero_with_one_line_naming_flag_and_fix() {
    for (args, needle) in [
        (vec!["serve", "--l1-size-gb", "0"], "--l1-size-gb 0"),
        (vec!["serve", "--l1-size-gb", "-1"], "--l1-size-gb -1"),
        (vec!["serve", "--l1-size-gb", "100000"], "pass at most"),
        (vec!["serve", "--eviction", "mru"], "use one of: lru, fifo"),
        (vec!["serve", "--port", "99999"], "--port"),
        (vec!["serve", "--chunk-tokens", "0"], "--chunk-tokens"),
        (vec!["serve", "--no-such-flag"], "--no-such-flag"),
        // Found trying kvd as a new user (issue #15).
        (
            vec!["serve", "--populate-threads", "100000"],
            "--populate-threads 100000",
        ),
        (
            vec!["serve", "--log-level", "verbose"],
            "--log-level verbose",
        ),
        (vec!["serve", "--slab-mb", "1"], "--slab-mb 1"),
        (vec!["serve", "--slab-mb", "-1"], "--slab-mb"),
        (vec!["serve", "--copy-queue", "-5"], "--copy-queue"),
    ] {
        let (code, err) = run(&args, &[]);
        assert_ne!(code, 0, "{args:?}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // --ipc naming a regular file: the error names --ipc, and no socket file is left behind.
    let dir = TempDir::new("cli");
    let file = dir.0.join("not-a-socket");
    std::fs::write(&file, b"x").unwrap();
    let fd = dir.0.join("fd.sock");
    let (code, err) = run(
        &[
            "serve",
            "--l1-size-gb",
            "0.25",
            "--port",
            "0",
            "--http-port",
            "0",
            "--ipc",
            file.to_str().unwrap(),
            "--fd-socket",
            fd.to_str().unwrap(),
        ],
        &[],
    );
    assert_ne!(code, 0);
    let fatal: Vec<&str> = err.lines().filter(|l| l.starts_with("kvd: ")).collect();
    assert_eq!(fatal.len(), 1, "{err}");
    assert!(
        fatal[0].contains("--ipc") && fatal[0].contains("not a socket"),
        "{err}"
    );
    assert!(!fd.exists(), "no fd socket left behind");
    let (code, err) = run(&["serve"], &[("TOTAL_CPU_DRAM_GB", "lots")]);
    assert_ne!(code, 0);
    assert!(
        err.contains("TOTAL_CPU_DRAM_GB") && err.contains("--l1-size-gb"),
        "{err}"
    );
    let (code, _) = run(&["--version"], &[]);
    assert_eq!(code, 0);
}

#[test]
fn a_port_in_use_is_refused_with_the_flag_named() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let dir = TempDir::new("port");
    let fd = dir.0.join("fd.sock");
    let fd = fd.to_str().unwrap();
    let (code, err) = run(
        &[
            "serve",
            "--l1-size-gb",
            "0.01",
            "--port",
            &port,
            "--http-port",
            "0",
            "--fd-socket",
            fd,
        ],
        &[],
    );
    assert_ne!(code, 0);
    let last = err.trim().lines().last().unwrap();
    assert!(
        last.contains(&format!("--port {port}"))
            && last.contains("in use")
            && last.contains("stop the process"),
        "{err}"
    );
    // A flag given twice takes its last value: this --http-port wins over serve()'s 0.
    let (code, err) = run(&serve(&["--http-port", &port, "--fd-socket", fd]), &[]);
    assert_ne!(code, 0);
    assert!(
        err.trim()
            .lines()
            .last()
            .unwrap()
            .contains(&format!("--http-port {port}")),
        "{err}"
    );
}

#[test]
fn healthz_is_503_while_populating_then_200() {
    // The first step is one 256 MiB slab, touched by one thread on 4 KiB pages: long enough
    // for the first probe to find it still populating.
    let kvd = Kvd::start(&[
        "--l1-size-gb",
        "4",
        "--populate-threads",
        "1",
        "--no-hugepages",
    ]);
    let (code, body) = kvd.get("/healthz");
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains("\"status\":\"populating\"") || body.contains("\"status\":\"starting\""),
        "{body}"
    );
    kvd.wait_healthy(Duration::from_secs(60));
    let (_, body) = kvd.get("/healthz");
    assert!(body.contains("\"status\":\"ok\""), "{body}");
    kvd.wait_pool_full(Duration::from_secs(120));
    let pool = kvd.pool_status();
    assert_eq!(pool["ready_bytes"], 4u64 << 30, "{pool}");
    assert_eq!(pool["total_bytes"], 4u64 << 30, "{pool}");
    assert!(pool["full_after_s"].as_f64().unwrap() > 0.0, "{pool}");
    assert_eq!(kvd.metric("kvd_pool_ready_bytes"), (4u64 << 30) as f64);
    let log = kvd.log();
    assert!(log.contains("L1 pool: 4.00 GiB (--l1-size-gb)"), "{log}");
    assert!(log.contains("L1 pool full: 4.0 GiB populated"), "{log}");
    assert!(
        log.contains("no GPU driver found"),
        "one clear warning without a GPU: {log}"
    );
    assert_eq!(kvd.metric("kvd_ready"), 1.0);
    assert_eq!(kvd.get("/nope").0, 404);
}

#[test]
fn total_cpu_dram_gb_sets_the_default_size() {
    let dir = TempDir::new("env");
    let fd = dir.0.join("fd.sock");
    let mut child = Command::new(kvd_bin())
        .args([
            "serve",
            "--port",
            "0",
            "--http-port",
            "0",
            "--fd-socket",
            fd.to_str().unwrap(),
        ])
        .env("TOTAL_CPU_DRAM_GB", "0.2")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut log = String::new();
    let mut buf = [0u8; 4096];
    use std::io::Read;
    while !log.contains("ready in") && Instant::now() < deadline {
        let n = err.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        log.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        log.contains("L1 pool: 0.15 GiB (75% of TOTAL_CPU_DRAM_GB=0.2)"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_answers_drains_unlinks_and_exits_zero_within_5s() {
    let dir = TempDir::new("term");
    let ipc = dir.0.join("kvd.sock");
    let mut kvd = Kvd::ready(&["--ipc", ipc.to_str().unwrap()]);
    let ipc_client = Client::connect(ClientConfig::new(
        format!("ipc://{}", ipc.display()),
        "ipc",
        Role::Tool,
    ))
    .await
    .unwrap();
    assert!(ipc_client.ping(Ping {}).await.is_ok());
    let kv = HostKv::vllm("LBNHC", 2, 32, 2, 16, 16, 2);
    let reg = kv.register(&ipc_client, 1, 0).await.unwrap();
    assert_eq!(kvd.metric("kvd_registered_workers"), 1.0);
    // Requests in flight while the signal arrives each get one answer (or a closed connection).
    let c = ipc_client.clone();
    let busy = tokio::spawn(async move {
        let mut answered = 0;
        for _ in 0..2000 {
            match c.ping(Ping {}).await {
                Ok(_) => answered += 1,
                Err(kvd_proto::client::ClientError::Server {
                    code: ErrorCode::ShuttingDown,
                    ..
                }) => answered += 1,
                Err(_) => break,
            }
        }
        answered
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let port = kvd.http.port();
    let zmq = kvd.zmq.clone();
    let fd_socket = kvd.fd_socket.clone();
    let (status, took) = tokio::task::block_in_place(|| kvd.terminate());
    assert_eq!(status.code(), Some(0), "{}", kvd.log());
    assert!(took < Duration::from_secs(5), "took {took:?}");
    assert!(busy.await.unwrap() > 0);
    assert!(!ipc.exists(), "ipc socket unlinked");
    assert!(!fd_socket.exists(), "fd socket unlinked");
    assert!(
        std::net::TcpListener::bind(("127.0.0.1", port)).is_ok(),
        "http port released"
    );
    let zport: u16 = zmq.rsplit(':').next().unwrap().parse().unwrap();
    assert!(
        std::net::TcpListener::bind(("127.0.0.1", zport)).is_ok(),
        "zmq port released"
    );
    let log = kvd.log();
    assert!(
        log.contains("SIGTERM received") && log.contains("stopped"),
        "{log}"
    );
    drop(reg);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_ipc_socket_is_replaced_and_silent_sessions_are_closed() {
    let dir = TempDir::new("stale");
    let ipc = dir.0.join("kvd.sock");
    drop(std::os::unix::net::UnixListener::bind(&ipc).unwrap());
    assert!(ipc.exists());
    let kvd = Kvd::ready(&[
        "--ipc",
        ipc.to_str().unwrap(),
        "--session-timeout-ms",
        "1000",
    ]);
    assert!(kvd.log().contains("removing stale socket"));

    let mut quiet = ClientConfig::new(&kvd.zmq, "quiet", Role::Worker);
    quiet.heartbeat = false;
    let quiet = Client::connect(quiet).await.unwrap();
    let kv = HostKv::vllm("LBNHC", 2, 32, 2, 16, 16, 2);
    kv.register(&quiet, 1, 0).await.unwrap();
    let chatty = Client::connect(ClientConfig::new(
        format!("ipc://{}", ipc.display()),
        "chatty",
        Role::Worker,
    ))
    .await
    .unwrap();
    kv.register(&chatty, 1, 1).await.unwrap();
    assert_eq!(kvd.metric("kvd_registered_workers"), 2.0);
    tokio::time::sleep(Duration::from_millis(2600)).await;
    assert_eq!(
        kvd.metric("kvd_registered_workers"),
        1.0,
        "the silent session's registration was released"
    );
    assert_eq!(kvd.metric("kvd_sessions_timed_out_total"), 1.0);
    assert!(!quiet.is_connected() || quiet.ping(Ping {}).await.is_err());
    assert!(chatty.ping(Ping {}).await.is_ok());
}
