//! Start-up defects found trying kvd as a new user would (issue #23): the default pool under a
//! cgroup memory limit set on kvd's own cgroup, a burst of stores right after `/healthz` turns
//! 200 on a growing pool, socket paths in missing directories, a bad `--host`, and two of
//! kvd's own flags colliding — all against the real binary.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use kvd_proto::wire::*;

#[test]
fn socket_paths_in_missing_directories_are_refused_and_none_is_made() {
    let dir = TempDir::new("nodir");
    let missing = dir.0.join("no").join("such");
    let sock = missing.join("kvd.sock").display().to_string();
    let fd_ok = dir.0.join("fd.sock").display().to_string();
    for (flag, args) in [
        ("--fd-socket", vec!["--fd-socket", sock.as_str()]),
        (
            "--ipc",
            vec!["--ipc", sock.as_str(), "--fd-socket", fd_ok.as_str()],
        ),
    ] {
        let (code, err) = run(&serve(&args));
        assert_ne!(code, 0, "{flag}: {err}");
        let line = fatal(&err);
        assert!(
            line.contains(&format!("{flag} {sock}")) && line.contains("does not exist"),
            "{line}"
        );
        assert!(!dir.0.join("no").exists(), "{flag}: kvd made a directory");
    }
}

#[test]
fn a_bad_host_is_reported_as_the_host_flag() {
    let dir = TempDir::new("host");
    let fd = dir.0.join("fd.sock").display().to_string();
    // TEST-NET-1: no interface of this machine has it, so binding fails (nothing is sent).
    for (flag, args) in [
        (
            "--host",
            vec!["--host", "192.0.2.1", "--fd-socket", fd.as_str()],
        ),
        (
            "--http-host",
            vec!["--http-host", "192.0.2.1", "--fd-socket", fd.as_str()],
        ),
    ] {
        let (code, err) = run(&serve(&args));
        assert_ne!(code, 0);
        let line = fatal(&err);
        assert!(line.contains(&format!("{flag} 192.0.2.1")), "{line}");
        assert!(!line.contains("port"), "not blamed on a port: {line}");
        assert!(line.contains("IP address of this machine"), "{line}");
    }
}

#[test]
fn two_kvd_flags_colliding_are_named_and_leave_no_socket_behind() {
    let dir = TempDir::new("collide");
    let sock = dir.0.join("kvd.sock").display().to_string();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let (code, err) = run(&[
        "serve",
        "--l1-size-gb",
        "0.01",
        "--port",
        &port,
        "--http-port",
        &port,
    ]);
    assert_ne!(code, 0);
    let line = fatal(&err);
    assert!(
        line.contains(&format!("--port {port} and --http-port {port}"))
            && !line.contains("another process"),
        "{line}"
    );
    let (code, err) = run(&serve(&["--ipc", &sock, "--fd-socket", &sock]));
    assert_ne!(code, 0);
    let line = fatal(&err);
    assert!(
        line.contains("--ipc") && line.contains("--fd-socket"),
        "{line}"
    );
    assert!(!Path::new(&sock).exists(), "a socket file was left behind");

    // A later bind failing (the HTTP port taken by someone else) removes the ipc socket kvd
    // had already made.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = taken.local_addr().unwrap().port().to_string();
    let fd = dir.0.join("fd.sock").display().to_string();
    let (code, err) = run(&serve(&[
        "--http-port",
        &busy,
        "--ipc",
        &sock,
        "--fd-socket",
        &fd,
    ]));
    assert_ne!(code, 0);
    assert!(
        fatal(&err).contains(&format!("--http-port {busy}")),
        "{err}"
    );
    assert!(
        !Path::new(&sock).exists(),
        "the ipc socket file was left behind"
    );
}

/// kvd's own cgroup directory in the hierarchy with the memory controller, and whether it is
/// cgroup v2 — read here independently of kvd's code.
fn own_memory_cgroup() -> (PathBuf, bool) {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for line in mountinfo.lines() {
        let (before, after) = line.split_once(" - ").unwrap();
        let f: Vec<&str> = before.split(' ').collect();
        let a: Vec<&str> = after.split(' ').collect();
        let v1 = a[0] == "cgroup" && a[2].split(',').any(|o| o == "memory");
        let v2 = a[0] == "cgroup2"
            && std::fs::read_to_string(Path::new(f[4]).join("cgroup.controllers"))
                .is_ok_and(|c| c.split_whitespace().any(|c| c == "memory"));
        if !(v1 || v2) {
            continue;
        }
        let own = cgroups
            .lines()
            .find_map(|l| {
                let mut p = l.splitn(3, ':');
                let (id, ctl, path) = (p.next()?, p.next()?, p.next()?);
                let ok = if v2 {
                    id == "0"
                } else {
                    ctl.split(',').any(|c| c == "memory")
                };
                ok.then(|| path.to_string())
            })
            .unwrap();
        let below = Path::new(&own)
            .strip_prefix(f[3])
            .map(Path::to_path_buf)
            .unwrap_or_default();
        return (Path::new(f[4]).join(below), v2);
    }
    panic!("no cgroup hierarchy with the memory controller is mounted here");
}

/// A cgroup under kvd's own with a memory limit, holding a child without one; removed on drop.
struct LimitedCgroup {
    parent: PathBuf,
    child: PathBuf,
}

impl LimitedCgroup {
    fn new(limit_bytes: u64) -> LimitedCgroup {
        let (own, v2) = own_memory_cgroup();
        let parent = own.join(format!("kvd-test-{}", std::process::id()));
        std::fs::create_dir(&parent).unwrap_or_else(|e| {
            panic!(
                "this test makes a cgroup under {} ({e}): run it as root (CI does) on a \
                 machine whose cgroup hierarchy allows it",
                own.display()
            )
        });
        let child = parent.join("kvd");
        let (limit_file, enable) = if v2 {
            ("memory.max", Some("+memory"))
        } else {
            ("memory.limit_in_bytes", None)
        };
        if let Some(e) = enable {
            std::fs::write(parent.join("cgroup.subtree_control"), e).unwrap();
        }
        std::fs::write(parent.join(limit_file), limit_bytes.to_string()).unwrap();
        std::fs::create_dir(&child).unwrap();
        LimitedCgroup { parent, child }
    }
}

impl Drop for LimitedCgroup {
    fn drop(&mut self) {
        for d in [&self.child, &self.parent] {
            for _ in 0..100 {
                if std::fs::remove_dir(d).is_ok() || !d.exists() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[test]
fn the_default_pool_fits_a_memory_limit_set_above_kvds_own_cgroup() {
    // The limit sits on the parent, as a systemd slice's or a pod's does; kvd runs in a child
    // without one. 75% of it is the default pool.
    let cg = LimitedCgroup::new(1 << 30);
    let dir = TempDir::new("cgroup");
    let fd = dir.0.join("fd.sock").display().to_string();
    let procs = cg.child.join("cgroup.procs").display().to_string();
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!("echo $$ > {procs} && exec \"$0\" \"$@\""))
        .arg(kvd_bin())
        .args([
            "serve",
            "--port",
            "0",
            "--http-port",
            "0",
            "--fd-socket",
            &fd,
        ])
        .env_remove("TOTAL_CPU_DRAM_GB")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut log = String::new();
    let mut pool_line = None;
    for line in BufReader::new(child.stderr.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        log.push_str(&line);
        log.push('\n');
        if line.contains("L1 pool: ") {
            pool_line = Some(line);
            break;
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    let line = pool_line.unwrap_or_else(|| panic!("kvd did not say its pool size:\n{log}"));
    assert!(
        line.contains("L1 pool: 0.75 GiB") && line.contains("cgroup memory limit of 1.0 GiB"),
        "the default pool ignores the cgroup limit: {line}"
    );
    assert!(
        line.contains(&*cg.parent.display().to_string()),
        "names the cgroup: {line}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_stores_right_after_healthz_is_stored_while_the_pool_grows() {
    // 32 layers × 8 heads × 16 tokens × 256 × bf16: 2 MiB blocks, 8 MiB chunks of 64 tokens;
    // 8 requests of 4 chunks (256 MiB) at once, as a benchmark's first burst. The pool: 4 GiB
    // on 4 KiB pages grown by one thread from one 64 MiB slab, so seconds of growth. Before,
    // the burst was refused past the first slab, or evicted its own first chunks to make room,
    // and the first lookup missed.
    let kv = HostKv::vllm("BLNHC", 32, 128, 8, 16, 256, 2);
    kv.fill_random(&mut Rng(0xb125));
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
    let client = kvd.client("burst").await;
    let reg = kv.register(&client, 0xb125, 0).await.unwrap();
    let per = reg.chunk_blocks;
    assert_eq!(per, 4);
    let ready = kvd.pool_status()["ready_bytes"].as_u64().unwrap();
    assert!(
        ready < 256 << 20,
        "the pool had {ready} bytes ready before the burst, so this run proves nothing"
    );
    let requests = (0..8u32).map(|r| {
        let chunks: Vec<ChunkBlocks> = (0..4u32)
            .map(|c| {
                let first = (r * 4 + c) * per;
                chunk(
                    0xb0_0000 + u128::from(r * 4 + c),
                    (first..first + per).collect(),
                )
            })
            .collect();
        client.store(Store {
            region: reg.region,
            salt: 0,
            chunks,
            wait_slot: None,
            deadline_ns: 0,
        })
    });
    for reply in futures_util::future::join_all(requests).await {
        assert_eq!(
            reply.unwrap().outcomes,
            vec![StoreOutcome::Stored; 4],
            "{}",
            kvd.log()
        );
    }
    assert_eq!(
        kvd.metric(r#"kvd_store_chunks_total{outcome="refused_pool_full""#),
        0.0
    );
    let hashes: Vec<u128> = (0..32u128).map(|i| 0xb0_0000 + i).collect();
    let hit = client
        .lookup(Lookup {
            fingerprint: 0xb125,
            salt: 0,
            shards: vec![0],
            hashes: hashes.clone(),
            pin: true,
            readers: 1,
            held: 0,
        })
        .await
        .unwrap();
    assert_eq!(
        kvd.metric("kvd_evictions_total"),
        0.0,
        "the burst evicted its own chunks"
    );
    assert_eq!(
        hit.hit_chunks,
        32,
        "the first lookup hits the whole burst; log:\n{}",
        kvd.log()
    );
    // A sample comes back bit-exact (chunk 0 and the last) into blocks 0.. after zeroing.
    let want: Vec<Vec<u8>> = [0, 1, 2, 3, 124, 125, 126, 127]
        .iter()
        .map(|&b| kv.block_bytes(b))
        .collect();
    kv.allocations[0].write(0, &vec![0u8; 8 << 20]).unwrap();
    let got = client
        .retrieve(Retrieve {
            region: reg.region,
            salt: 0,
            pin_id: hit.pin_id,
            chunks: vec![
                chunk(hashes[0], vec![0, 1, 2, 3]),
                chunk(hashes[31], vec![4, 5, 6, 7]),
            ],
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(got.outcomes, vec![RetrieveOutcome::Loaded; 2]);
    let back: Vec<Vec<u8>> = (0..8).map(|b| kv.block_bytes(b)).collect();
    assert!(back == want, "retrieved blocks differ from the stored ones");
}
