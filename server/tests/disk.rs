//! The disk tier against real files under a temp dir, through a real kvd: chunks evicted from
//! a small L1 come back from disk bit-exact and survive a restart; values damaged or swapped
//! on disk are rejected and never delivered; a lookup answers before the disk reads and the
//! load waits for them; a full filesystem and a slow disk leave kvd serving from L1 within
//! the deadline. Runs with O_DIRECT (the temp dir's ext4/xfs) and
//! through the page cache (`--disk-direct off`, and a small tmpfs).

mod common;

use std::ops::Range;
use std::path::Path;
use std::time::{Duration, Instant};

use common::small::*;
use common::*;
use kvd_proto::client::Client;
use kvd_proto::wire::*;

const FP: u64 = 0xd15c;
/// 4 KiB chunks take 8 KiB on disk (a header block, then the page: read straight into L1).
const SLOT: u64 = 8192;
/// Where values start in a drive: kvd keeps its first MiB for its label.
const DATA: u64 = 1 << 20;

/// A kvd with a 2 MiB L1 (512 chunks) and a disk tier on two files in `dir`.
fn kvd_disk(dir: &Path, extra: &[&str]) -> Kvd {
    let disks = format!("{},{}", dir.join("d0").display(), dir.join("d1").display());
    let mut args = vec![
        "--chunk-tokens",
        "32",
        "--l1-size-gb",
        "0.002",
        "--disk",
        &disks,
        // The tests know which chunks leave L1 first (request by request, head first): the
        // order of a FIFO-like policy, not the prefix-aware default's tail-first one.
        "--eviction",
        "s3fifo",
    ];
    let has_size = extra.contains(&"--disk-size-gb");
    if !has_size {
        args.extend_from_slice(&["--disk-size-gb", "0.0625"]);
    }
    args.extend_from_slice(extra);
    Kvd::ready(&args)
}

/// A kvd with a 2 MiB L1 (512 chunks) and a disk tier on one file in `dir`, evicting by
/// `policy`.
fn kvd_one_disk(dir: &Path, policy: &str, extra: &[&str]) -> Kvd {
    let disk = dir.join("d0").display().to_string();
    let mut args = vec![
        "--chunk-tokens",
        "32",
        "--l1-size-gb",
        "0.002",
        "--disk",
        &disk,
        "--disk-size-gb",
        "0.0625",
        "--eviction",
        policy,
    ];
    args.extend_from_slice(extra);
    Kvd::ready(&args)
}

fn lookup(h: &[u128]) -> Lookup {
    Lookup {
        fingerprint: FP,
        salt: 0,
        shards: vec![0],
        hashes: h.to_vec(),
        pin: true,
        readers: 1,
        held: 0,
    }
}

/// A lookup of `h` from a client whose own prefix cache holds its first `held` chunks.
fn holding(held: u32, h: &[u128]) -> Lookup {
    Lookup { held, ..lookup(h) }
}

fn disk_health(kvd: &Kvd) -> serde_json::Value {
    let (code, body) = kvd.get("/healthz");
    assert_eq!(code, 200, "the disk tier never makes kvd unhealthy: {body}");
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["disk"].clone()
}

/// Waits until the disk tier has written (or given back) every chunk L1 handed it.
fn wait_evictions_settled(kvd: &Kvd) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let writing = kvd.metric("kvd_l1_disk_writing_bytes");
        if writing == 0.0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{writing} bytes of L1 still being written to disk; log:\n{}",
            kvd.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

async fn store(client: &Client, reg: &Registered, h: &[u128]) {
    store_expecting(client, reg, h, StoreOutcome::Stored).await;
}

async fn store_expecting(client: &Client, reg: &Registered, h: &[u128], outcome: StoreOutcome) {
    let reply = client
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks: chunks(h, &blocks_of(0, h.len())),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    assert_eq!(reply.outcomes, vec![outcome; h.len()]);
}

/// Stores 20 requests of 32 chunks (640 chunks through 512 pages), all from the same blocks,
/// letting the disk take each request's evictions before the next.
async fn fill(kvd: &Kvd, client: &Client, reg: &Registered) -> Vec<Vec<u128>> {
    let requests: Vec<Vec<u128>> = (0..20).map(|r| hashes(r * 10_000, 32)).collect();
    for h in &requests {
        store(client, reg, h).await;
        wait_evictions_settled(kvd);
    }
    assert!(kvd.metric("kvd_evictions_total") >= 128.0);
    requests
}

/// Retrieves chunks `range` of `h` into fresh memory, at the blocks they were stored from,
/// under `pin_id`: the chunks loaded (the range's head; the rest must be missing), every byte
/// of them checked against `src`.
async fn retrieve_and_check(
    client: &Client,
    h: &[u128],
    range: Range<usize>,
    pin_id: u64,
    src: &[Vec<u8>],
) -> u32 {
    let dst = cache(99);
    let reg = dst.register(client, FP, 0).await.unwrap();
    let reply = client
        .retrieve(Retrieve {
            region: reg.region,
            salt: 0,
            pin_id,
            chunks: chunks(
                &h[range.clone()],
                &blocks_of(range.start as u32 * PER, range.len()),
            ),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    let loaded = reply
        .outcomes
        .iter()
        .take_while(|&&o| o == RetrieveOutcome::Loaded)
        .count();
    assert!(
        reply.outcomes[loaded..]
            .iter()
            .all(|&o| o == RetrieveOutcome::Missing),
        "{:?}",
        reply.outcomes
    );
    let blocks = range.start * PER as usize..(range.start + loaded) * PER as usize;
    for (b, want) in src.iter().enumerate().take(blocks.end).skip(blocks.start) {
        assert!(
            dst.block_bytes(b as u32) == *want,
            "block {b} differs after the trip through the disk"
        );
    }
    loaded as u32
}

/// Looks `h` up and retrieves what the lookup reports: the chunks loaded, checked byte for byte.
async fn hit_and_check(client: &Client, h: &[u128], src: &[Vec<u8>]) -> u32 {
    let hit = client.lookup(lookup(h)).await.unwrap();
    let n = hit.hit_chunks as usize;
    let loaded = if n > 0 {
        retrieve_and_check(client, h, 0..n, hit.pin_id, src).await
    } else {
        0
    };
    if hit.pin_id != 0 {
        client
            .release(Release { pin_id: hit.pin_id })
            .await
            .unwrap();
    }
    loaded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_evicted_from_l1_come_back_from_disk_and_survive_a_restart() {
    let dir = TempDir::new("disk-restart");
    let mut a = kvd_disk(&dir.0, &[]);
    let h = disk_health(&a);
    assert_eq!(h["state"], "up", "{h}");
    assert!(
        h["last_error"].is_null() && h["last_error_age_s"].is_null(),
        "{h}"
    );
    assert_eq!(h["drives"].as_array().unwrap().len(), 2);
    let direct = h["drives"][0]["direct"].as_bool().unwrap();
    eprintln!("disk tier on {} with O_DIRECT: {direct}", dir.0.display());
    let ca = a.client("a").await;
    let kv = cache(1);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    let requests = fill(&a, &ca, &reg).await;
    let written = a.metric(r#"kvd_disk_evicted_chunks_total{outcome="written""#);
    assert!(written >= 128.0, "{written} written; log:\n{}", a.log());
    assert_eq!(
        a.metric(r#"kvd_disk_evicted_chunks_total{outcome="dropped_busy""#),
        0.0
    );
    assert_eq!(
        a.metric(r#"kvd_disk_bytes_total{direction="write""#),
        written * 4096.0
    );
    // The first two requests left L1; a lookup brings the first back from disk.
    assert_eq!(hit_and_check(&ca, &requests[0], &src).await, 32);
    assert_eq!(
        a.metric(r#"kvd_disk_lookup_chunks_total{result="hit""#),
        32.0
    );
    // 4 KiB pages are whole blocks: each was read by the drive straight into its L1 page.
    assert_eq!(a.metric("kvd_disk_direct_reads_total"), 32.0);
    assert_eq!(a.metric("kvd_disk_rejected_values_total"), 0.0);
    // Bringing it back evicted others: let the disk take them before counting.
    wait_evictions_settled(&a);
    // The pool is registered with both rings as io_uring fixed buffers: every page went to and
    // from disk with ReadFixed/WriteFixed (the bytes were checked above); only the header
    // blocks, in buffers of their own, are plain I/Os.
    let ios = |buffer: &str, direction: &str| {
        a.metric(&format!(
            r#"kvd_disk_ios_total{{buffer="{buffer}",direction="{direction}""#
        ))
    };
    assert_eq!(ios("fixed", "read"), 32.0, "log:\n{}", a.log());
    assert_eq!(ios("plain", "read"), 32.0);
    assert!(ios("fixed", "write") >= written, "log:\n{}", a.log());
    assert_eq!(ios("fixed", "write"), ios("plain", "write"));
    assert!(a.metric(r#"kvd_disk_fixed_buffer_bytes{ring="read""#) > 0.0);
    assert!(
        a.log().contains("io_uring fixed buffers"),
        "log:\n{}",
        a.log()
    );
    let chunks_before = disk_health(&a)["chunks"].as_u64().unwrap();
    assert!(chunks_before >= 64, "{}", disk_health(&a));

    // A clean restart keeps the disk's chunks: an empty L1 finds the second request there.
    let (status, _) = a.terminate();
    assert!(status.success(), "log:\n{}", a.log());
    assert!(a.log().contains("index of"), "log:\n{}", a.log());
    let b = kvd_disk(&dir.0, &[]);
    assert_eq!(
        disk_health(&b)["chunks"].as_u64().unwrap(),
        chunks_before,
        "log:\n{}",
        b.log()
    );
    let cb = b.client("b").await;
    let kv_b = cache(1);
    kv_b.register(&cb, FP, 0).await.unwrap();
    assert_eq!(hit_and_check(&cb, &requests[1], &src).await, 32);
    assert_eq!(
        b.metric(r#"kvd_disk_lookup_chunks_total{result="hit""#),
        32.0
    );
    assert_eq!(b.metric("kvd_disk_rejected_values_total"), 0.0);
}

/// Overwrites `len` bytes of `file` at `at` with `bytes`.
fn poke(file: &Path, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
    f.write_all_at(bytes, at).unwrap();
    f.sync_all().unwrap();
}

fn peek(file: &Path, at: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(file).unwrap();
    let mut b = vec![0u8; len];
    f.read_exact_at(&mut b, at).unwrap();
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_damaged_or_swapped_on_disk_are_rejected_and_never_delivered() {
    let dir = TempDir::new("disk-damage");
    let mut a = kvd_disk(&dir.0, &["--disk-direct", "off"]);
    assert_eq!(disk_health(&a)["drives"][0]["direct"], false);
    let ca = a.client("a").await;
    let kv = cache(2);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    let requests = fill(&a, &ca, &reg).await;
    assert!(a.terminate().0.success());
    // The first evicted chunks lie at the start of each file, in turn: the first request's
    // chunk 0 at d0's first slot, chunk 1 at d1's. Swap in another chunk's bytes for one and
    // flip a payload bit of the other.
    let (d0, d1) = (dir.0.join("d0"), dir.0.join("d1"));
    poke(&d0, DATA, &peek(&d0, DATA + SLOT, SLOT as usize));
    // A payload byte: the page starts after the 4 KiB header block.
    let mut byte = peek(&d1, DATA + 4096 + 1000, 1);
    byte[0] ^= 0x10;
    poke(&d1, DATA + 4096 + 1000, &byte);

    let b = kvd_disk(&dir.0, &["--disk-direct", "off"]);
    let cb = b.client("b").await;
    cache(2).register(&cb, FP, 0).await.unwrap();
    // The index still names them, so the lookup usually reports them (the disk answers before
    // its reads) and the load finds them missing. Its read thread may also have found them bad
    // before the lookup counted them (seen on a loaded 2-core CI machine): then it reports
    // none. Either way, nothing of them loads.
    let hit = cb.lookup(lookup(&requests[0])).await.unwrap();
    let n = hit.hit_chunks as usize;
    if n > 0 {
        assert_eq!(
            retrieve_and_check(&cb, &requests[0], 0..n, hit.pin_id, &src).await,
            0
        );
    }
    cb.release(Release { pin_id: hit.pin_id }).await.unwrap();
    // The lookup's reads reject both, whichever answered first.
    common::l2::wait_metric(&b, "kvd_disk_rejected_values_total", 2.0);
    assert_eq!(
        b.metric(r#"kvd_disk_rejected_values_total{reason="foreign""#),
        1.0,
        "log:\n{}",
        b.log()
    );
    assert_eq!(
        b.metric(r#"kvd_disk_rejected_values_total{reason="corrupt""#),
        1.0
    );
    // Rejected values leave the index: asking again reads nothing bad.
    assert_eq!(hit_and_check(&cb, &requests[0], &src).await, 0);
    assert_eq!(b.metric("kvd_disk_rejected_values_total"), 2.0);
    // The second request was untouched and still comes back whole.
    assert_eq!(hit_and_check(&cb, &requests[1], &src).await, 32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_answers_before_the_disk_reads_and_the_load_waits_for_them() {
    let dir = TempDir::new("disk-overlap");
    let a = kvd_disk(
        &dir.0,
        &[
            "--disk-deadline-ms",
            "5000",
            "--disk-inject-delay-ms",
            "600",
        ],
    );
    let ca = a.client("a").await;
    let kv = cache(6);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    let requests = fill(&a, &ca, &reg).await;
    // The lookup counts the disk's chunks without waiting for the reads (600 ms here) ...
    let t = Instant::now();
    let hit = ca.lookup(lookup(&requests[0])).await.unwrap();
    let answered = t.elapsed();
    assert_eq!(hit.hit_chunks, 32, "log:\n{}", a.log());
    assert!(
        answered < Duration::from_millis(400),
        "the lookup took {answered:?}"
    );
    // ... and the retrieve waits for them, then loads every byte.
    assert_eq!(
        retrieve_and_check(&ca, &requests[0], 0..32, hit.pin_id, &src).await,
        32
    );
    let loaded = t.elapsed();
    assert!(
        loaded >= Duration::from_millis(600),
        "the load took {loaded:?}"
    );
    assert_eq!(
        a.metric(r#"kvd_disk_lookup_chunks_total{result="hit""#),
        32.0
    );
    assert_eq!(a.metric("kvd_disk_load_timeouts_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_disk_costs_a_load_at_most_the_deadline() {
    let dir = TempDir::new("disk-slow");
    let a = kvd_disk(
        &dir.0,
        &[
            "--disk-deadline-ms",
            "100",
            "--disk-inject-delay-ms",
            "1500",
        ],
    );
    let ca = a.client("a").await;
    let kv = cache(3);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    let requests = fill(&a, &ca, &reg).await;
    // The lookup answers at once; the retrieve gives up on the reads at the deadline and
    // finds the chunks missing (vLLM recomputes them).
    let t = Instant::now();
    let hit = ca.lookup(lookup(&requests[0])).await.unwrap();
    assert_eq!(hit.hit_chunks, 32);
    assert_eq!(
        retrieve_and_check(&ca, &requests[0], 0..32, hit.pin_id, &src).await,
        0
    );
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(100) && took < Duration::from_millis(1000),
        "the lookup and load took {took:?}"
    );
    assert_eq!(a.metric("kvd_disk_load_timeouts_total"), 1.0);
    // Paced to the drive: later lookups may read for half the deadline, not all of it.
    assert_eq!(a.metric("kvd_disk_read_deadline_share"), 0.5);
    // L1 kept serving meanwhile.
    assert_eq!(hit_and_check(&ca, &requests[19], &src).await, 32);
    // The late reads still land in L1 and serve the next lookup.
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.metric(r#"kvd_disk_fill_chunks_total{outcome="filled""#) < 32.0 {
        assert!(Instant::now() < deadline, "log:\n{}", a.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(hit_and_check(&ca, &requests[0], &src).await, 32);
    assert_eq!(a.metric("kvd_disk_load_timeouts_total"), 1.0);
    // A read that took longer than its share gives none of it back.
    assert_eq!(a.metric("kvd_disk_read_deadline_share"), 0.5);
}

/// A small tmpfs mounted for one test, unmounted on drop.
struct SmallFs(TempDir);

impl SmallFs {
    fn mount(size: &str) -> SmallFs {
        let dir = TempDir::new("disk-smallfs");
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir.0)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "this test needs a small tmpfs (run as root): mount said {}",
            String::from_utf8_lossy(&out.stderr)
        );
        SmallFs(dir)
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg(&self.0 .0)
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_filesystem_leaves_kvd_serving_from_l1_and_says_so() {
    let fs = SmallFs::mount("6m");
    // 64 MiB asked of a 6 MiB filesystem.
    let a = kvd_disk(&fs.0 .0, &[]);
    let h = disk_health(&a);
    assert_eq!(h["state"], "down", "{h}");
    assert_eq!(h["drives"][0]["state"], "full", "{h}");
    assert!(
        h["last_error"].as_str().unwrap().contains("--disk-size-gb"),
        "{h}"
    );
    assert!(h["last_error_age_s"].as_f64().unwrap() < 60.0, "{h}");
    assert_eq!(a.metric("kvd_disk_up"), 0.0);
    let ca = a.client("a").await;
    let kv = cache(4);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    let requests = fill(&a, &ca, &reg).await;
    assert_eq!(
        a.metric(r#"kvd_disk_evicted_chunks_total{outcome="written""#),
        0.0
    );
    assert_eq!(hit_and_check(&ca, &requests[19], &src).await, 32);
    assert_eq!(hit_and_check(&ca, &requests[0], &src).await, 0);

    // Nothing was allocated for it: a size that fits (two files of 1 MiB and kvd's 1 MiB label
    // each) works on the same tmpfs (page cache or O_DIRECT, whichever it takes).
    drop(a);
    let b = kvd_disk(&fs.0 .0, &["--disk-size-gb", "0.002"]);
    assert_eq!(disk_health(&b)["state"], "up", "{}", b.log());
    let cb = b.client("b").await;
    let reg = kv.register(&cb, FP, 0).await.unwrap();
    let requests = fill(&b, &cb, &reg).await;
    assert!(b.metric(r#"kvd_disk_evicted_chunks_total{outcome="written""#) > 0.0);
    assert_eq!(
        hit_and_check(&cb, &requests[3], &src).await,
        32,
        "{}",
        b.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_l2_too_a_lookup_asks_l1_then_the_disk_then_l2() {
    let server = common::redis_servers::RedisServer::start(&[]);
    let url = server.url();
    let dir = TempDir::new("disk-l2");
    let mut a = kvd_disk(&dir.0, &["--l2", &url]);
    let ca = a.client("a").await;
    let kv = cache(5);
    let reg = kv.register(&ca, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    let requests = fill(&a, &ca, &reg).await;
    let written = r#"kvd_l2_write_behind_total{outcome="written""#;
    let deadline = Instant::now() + Duration::from_secs(30);
    while a.metric(written) < 640.0 {
        assert!(
            Instant::now() < deadline,
            "L2 write-behind stalled; log:\n{}",
            a.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Evicted from L1, on disk and in L2: the disk answers, L2 is not asked for it.
    assert_eq!(hit_and_check(&ca, &requests[0], &src).await, 32);
    assert_eq!(
        a.metric(r#"kvd_disk_lookup_chunks_total{result="hit""#),
        32.0
    );
    assert_eq!(a.metric(r#"kvd_l2_lookup_chunks_total{result="hit""#), 0.0);
    // The client holds request 2's first 20 chunks, which L1 lost and the disk keeps: the disk
    // reads the other 12, and L2 is asked for none of the 32 (before 3e49a7e, for all 32).
    let l2_asked = |k: &Kvd| {
        k.metric(r#"kvd_l2_lookup_chunks_total{result="hit""#)
            + k.metric(r#"kvd_l2_lookup_chunks_total{result="miss""#)
    };
    let hit = ca.lookup(holding(20, &requests[2])).await.unwrap();
    assert_eq!(hit.hit_chunks, 32, "log:\n{}", a.log());
    assert_eq!(
        retrieve_and_check(&ca, &requests[2], 20..32, hit.pin_id, &src).await,
        12
    );
    assert_eq!(
        a.metric(r#"kvd_disk_fill_chunks_total{outcome="client_holds""#),
        20.0
    );
    assert_eq!(l2_asked(&a), 0.0, "log:\n{}", a.log());
    // Held chunks kept partly on disk, partly in L1: 4 that only the disk keeps, 8 that only
    // L1 holds (the last request stored, never evicted), 8 more that only the disk keeps; then
    // 12 the client lacks, which the disk reads. L2 is asked for none: the held ones are kept,
    // the rest are being read.
    let mixed: Vec<u128> = [&requests[5][..4], &requests[19][..8], &requests[5][12..]].concat();
    let hit = ca.lookup(holding(20, &mixed)).await.unwrap();
    assert_eq!(hit.hit_chunks, 32, "log:\n{}", a.log());
    ca.release(Release { pin_id: hit.pin_id }).await.unwrap();
    assert_eq!(l2_asked(&a), 0.0, "log:\n{}", a.log());
    assert!(a.terminate().0.success());
    // A node with an empty disk and an empty L1: L2 answers.
    let other = TempDir::new("disk-l2-empty");
    let b = kvd_disk(&other.0, &["--l2", &url]);
    let cb = b.client("b").await;
    cache(5).register(&cb, FP, 0).await.unwrap();
    assert_eq!(
        hit_and_check(&cb, &requests[1], &src).await,
        32,
        "log:\n{}",
        b.log()
    );
    assert_eq!(
        b.metric(r#"kvd_disk_lookup_chunks_total{result="hit""#),
        0.0
    );
    assert_eq!(b.metric(r#"kvd_l2_lookup_chunks_total{result="hit""#), 32.0);
    // What the client holds and no tier above keeps, L2 fetches: the hit cannot reach past it
    // otherwise.
    let hit = cb.lookup(holding(20, &requests[3])).await.unwrap();
    assert_eq!(hit.hit_chunks, 32, "log:\n{}", b.log());
    assert_eq!(l2_asked(&b), 64.0);
}

/// A cache of 4 MiB chunks (8 layers × 8 heads × 1024 elements × 2 bytes × 32 tokens), big
/// enough that the disk tier hashes them on several threads (a lookup's values in
/// `check_all`, evicted pages in `hash_ahead`): 8 blocks, 4 chunks.
fn big_cache(seed: u64) -> HostKv {
    let kv = HostKv::vllm("BLNHC", 8, 8, 8, 16, 1024, 2);
    kv.fill_random(&mut Rng(seed));
    kv
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_chunks_checked_on_several_threads_keep_their_order() {
    let dir = TempDir::new("disk-large");
    // 32 pages of 4 MiB in L1 (128 MiB: kvd gives a pool that small 8 MiB slabs); one drive,
    // through the page cache so that a byte changed on disk is what the next read sees.
    let kvd = Kvd::ready(&[
        "--chunk-tokens",
        "32",
        "--l1-size-gb",
        "0.125",
        "--disk",
        &dir.0.join("d0").display().to_string(),
        "--disk-size-gb",
        "0.25",
        "--disk-direct",
        "off",
        "--eviction",
        "s3fifo",
    ]);
    let client = kvd.client("large").await;
    let kv = big_cache(5);
    let reg = kv.register(&client, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..8).map(|b| kv.block_bytes(b)).collect();
    // Nine requests of four chunks through 32 pages: the first two leave L1. One chunk a
    // store, each store's victim written before the next: the disk tier keeps an eighth of this
    // pool (four pages) free, being written or written (clean), and a store that needs more
    // than that at once evicts the rest unwritten. (Those four pages are also what one fill
    // may take: a fill takes only free or clean pages.)
    let requests: Vec<Vec<u128>> = (0..9).map(|r| hashes(r * 10_000, 4)).collect();
    for h in &requests {
        for (i, &hash) in h.iter().enumerate() {
            let reply = client
                .store(Store {
                    region: reg.region,
                    salt: 0,
                    chunks: chunks(&[hash], &blocks_of(i as u32 * PER, 1)),
                    wait_slot: None,
                    deadline_ns: 0,
                })
                .await
                .unwrap();
            assert_eq!(reply.outcomes, vec![StoreOutcome::Stored]);
            wait_evictions_settled(&kvd);
        }
    }
    assert!(
        kvd.metric(r#"kvd_disk_evicted_chunks_total{outcome="written""#) >= 4.0,
        "log:\n{}",
        kvd.log()
    );
    // The first request's four chunks left L1 first and lie on disk in that order, each a
    // header block and its 4 MiB page: damage the third one's page.
    let slot = 4096 + (4 << 20);
    let d0 = dir.0.join("d0");
    let at = DATA + 2 * slot + 4096 + 12_345;
    let mut byte = peek(&d0, at, 1);
    byte[0] ^= 0x01;
    poke(&d0, at, &byte);
    // One fill reads all four (16 MiB: two checking threads); the damaged third is rejected,
    // so the load is the two before it, byte for byte — a result put back out of order would
    // reject another chunk or deliver the damaged one.
    let hit = client.lookup(lookup(&requests[0])).await.unwrap();
    assert_eq!(hit.hit_chunks, 4, "log:\n{}", kvd.log());
    let dst = big_cache(99);
    let dreg = dst.register(&client, FP, 0).await.unwrap();
    let reply = client
        .retrieve(Retrieve {
            region: dreg.region,
            salt: 0,
            pin_id: hit.pin_id,
            chunks: chunks(&requests[0], &blocks_of(0, 4)),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await
        .unwrap();
    use RetrieveOutcome::{Loaded, Missing};
    assert_eq!(reply.outcomes, vec![Loaded, Loaded, Missing, Missing]);
    assert_eq!(
        kvd.metric(r#"kvd_disk_rejected_values_total{reason="corrupt""#),
        1.0
    );
    for (b, want) in src.iter().enumerate().take(4) {
        assert!(
            dst.block_bytes(b as u32) == *want,
            "block {b} differs after the trip through the disk"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fill_keeps_the_head_of_the_prefix_it_extends() {
    let dir = TempDir::new("disk-head");
    // 512 pages of 4 KiB; the disk tier keeps an eighth of them (64) for its writes, so L1
    // holds 448 chunks. LRU, so that which chunk goes next is known.
    let kvd = kvd_one_disk(&dir.0, "lru", &[]);
    let client = kvd.client("head").await;
    let kv = cache(7);
    let reg = kv.register(&client, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    let x = hashes(0, 32);
    let store_at = |h: Vec<u128>, first_block: u32| {
        let client = &client;
        let kvd = &kvd;
        async move {
            let reply = client
                .store(Store {
                    region: reg.region,
                    salt: 0,
                    chunks: chunks(&h, &blocks_of(first_block, h.len())),
                    wait_slot: None,
                    deadline_ns: 0,
                })
                .await
                .unwrap();
            assert_eq!(reply.outcomes, vec![StoreOutcome::Stored; h.len()]);
            wait_evictions_settled(kvd);
        }
    };
    // X's tail, then its head: the tail is the oldest data, the head next.
    store_at(x[16..].to_vec(), 16 * PER).await;
    store_at(x[..16].to_vec(), 0).await;
    // 432 chunks more: the last 16 find L1 full and evict X's tail, which the disk takes,
    // and leave X's head the oldest data in L1.
    for r in 1..=14u32 {
        let n = if r == 14 { 16 } else { 32 };
        store_at(hashes(r * 10_000, n), 0).await;
    }
    let written = r#"kvd_disk_evicted_chunks_total{outcome="written""#;
    assert_eq!(kvd.metric(written), 16.0, "log:\n{}", kvd.log());
    assert_eq!(kvd.metric("kvd_evictions_total"), 16.0);
    // A lookup of X finds its head in L1 and its tail on disk. Filling the tail evicts 16
    // chunks as a store of it would, and they go to the disk; none may be X's head (the
    // oldest data left), or the lookup would report nothing.
    assert_eq!(
        hit_and_check(&client, &x, &src).await,
        32,
        "log:\n{}",
        kvd.log()
    );
    assert_eq!(
        kvd.metric(r#"kvd_disk_lookup_chunks_total{result="hit""#),
        16.0
    );
    assert_eq!(kvd.metric("kvd_evictions_total"), 32.0);
    wait_evictions_settled(&kvd);
    assert_eq!(kvd.metric(written), 32.0, "log:\n{}", kvd.log());
}

/// A kvd with a 2 MiB L1 (512 pages of 4 KiB) and one 4 KiB write in flight (the least
/// reserve twice that, two pages), with L1 filled to the pool less that reserve (510 chunks)
/// and then a burst of 32 evictions at once, faster than any drive: two go to the disk with
/// their pages, 30 are lost for want of room. Returns the kvd, its client, the registration
/// and the cache it registered (kept alive for the test's length).
async fn paced_reserve_after_a_burst(
    dir: &Path,
    extra: &[&str],
) -> (Kvd, Client, Registered, HostKv) {
    let mut args = vec!["--disk-queue-depth", "1", "--disk-io-kb", "4"];
    args.extend_from_slice(extra);
    let kvd = kvd_one_disk(dir, "s3fifo", &args);
    assert_eq!(reserve_pages(&kvd), 2.0, "log:\n{}", kvd.log());
    let client = kvd.client("pace").await;
    let kv = cache(3);
    let reg = kv.register(&client, FP, 0).await.unwrap();
    for r in 0..16u32 {
        let n = if r == 15 { 30 } else { 32 };
        store(&client, &reg, &hashes(r * 10_000, n)).await;
    }
    wait_evictions_settled(&kvd);
    assert_eq!(kvd.metric("kvd_evictions_total"), 0.0);
    store(&client, &reg, &hashes(200_000, 32)).await;
    wait_evictions_settled(&kvd);
    assert_eq!(dropped_busy(&kvd), 30.0, "log:\n{}", kvd.log());
    (kvd, client, reg, kv)
}

fn reserve_pages(kvd: &Kvd) -> f64 {
    kvd.metric("kvd_l1_disk_reserve_bytes") / 4096.0
}

fn dropped_busy(kvd: &Kvd) -> f64 {
    kvd.metric(r#"kvd_disk_evicted_chunks_total{outcome="dropped_busy""#)
}

/// The reserve L1 keeps for the disk tier's writes is paced to the drive: a burst of
/// evictions past it loses victims once, the reserve grows to what would have held the burst
/// when the drive catches up, and the next such burst is written whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_the_drive_caught_up_with_is_written_whole_the_next_time() {
    let dir = TempDir::new("disk-pace");
    // The most, given as 1 MiB, is held to an eighth of the pool: 64 pages.
    let (kvd, client, reg, _kv) =
        paced_reserve_after_a_burst(&dir.0, &["--disk-write-reserve-max-mb", "1"]).await;
    // The drive caught up with the burst: the reserve is what would have held all 32.
    assert_eq!(reserve_pages(&kvd), 32.0, "log:\n{}", kvd.log());
    // The grown reserve's pages are L1's chunks still: the next store's first 30 victims go
    // to the disk to make it (L1 now holds 480 chunks), and 30 of the store's own are lost.
    // That is no reason to grow again.
    let written = r#"kvd_disk_evicted_chunks_total{outcome="written""#;
    store(&client, &reg, &hashes(300_000, 32)).await;
    wait_evictions_settled(&kvd);
    assert_eq!(dropped_busy(&kvd), 60.0, "log:\n{}", kvd.log());
    assert_eq!(reserve_pages(&kvd), 32.0, "log:\n{}", kvd.log());
    // The reserve there, the next burst of 32 is written whole.
    let before = kvd.metric(written);
    store(&client, &reg, &hashes(350_000, 32)).await;
    wait_evictions_settled(&kvd);
    assert_eq!(dropped_busy(&kvd), 60.0, "log:\n{}", kvd.log());
    assert_eq!(kvd.metric(written), before + 32.0, "log:\n{}", kvd.log());
    assert_eq!(reserve_pages(&kvd), 32.0);
    assert_eq!(kvd.metric("kvd_disk_rejected_values_total"), 0.0);
}

/// Left to its default, the paced reserve grows no further than a 64th of the pool: every
/// page of it is one L1 does not cache in, and on the H100's agentic replay one that grew to
/// an eighth cost more hits than the disk gave back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_paced_reserve_stops_at_a_64th_of_the_pool_by_default() {
    let dir = TempDir::new("disk-pace-default");
    let (kvd, ..) = paced_reserve_after_a_burst(&dir.0, &[]).await;
    // The burst would have grown it to 32 pages; it stops at 512 / 64 = 8.
    assert_eq!(reserve_pages(&kvd), 8.0, "log:\n{}", kvd.log());
}

/// A chunk asked for again while the disk tier is still writing it (a drive behind) is taken
/// back into L1 from its page: a hit with every byte right, and written all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_asked_for_while_being_written_is_a_hit_from_its_page() {
    let dir = TempDir::new("disk-take-back");
    let kvd = kvd_disk(&dir.0, &["--disk-inject-write-delay-ms", "1500"]);
    let client = kvd.client("back").await;
    let kv = cache(5);
    let reg = kv.register(&client, FP, 0).await.unwrap();
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    // 512 pages less a reserve of 64: 14 requests of 32 fill L1, the 15th evicts the first.
    let requests: Vec<Vec<u128>> = (0..15).map(|r| hashes(r * 10_000, 32)).collect();
    for h in &requests {
        store(&client, &reg, h).await;
    }
    assert_eq!(kvd.metric("kvd_evictions_total"), 32.0);
    let written = r#"kvd_disk_evicted_chunks_total{outcome="written""#;
    assert_eq!(kvd.metric(written), 0.0, "the write thread is still asleep");
    assert_eq!(kvd.metric("kvd_l1_disk_writing_bytes"), 32.0 * 4096.0);
    // Asked for again: all 32 from L1, checked byte for byte, none read from disk.
    assert_eq!(hit_and_check(&client, &requests[0], &src).await, 32);
    assert_eq!(kvd.metric("kvd_l1_disk_taken_back_total"), 32.0);
    assert_eq!(kvd.metric("kvd_l1_disk_writing_bytes"), 0.0);
    assert_eq!(
        kvd.metric(r#"kvd_disk_lookup_chunks_total{result="hit""#),
        0.0
    );
    // The writes go on from the same pages, and leave the chunks in L1.
    let deadline = Instant::now() + Duration::from_secs(30);
    while kvd.metric(written) < 32.0 {
        assert!(Instant::now() < deadline, "log:\n{}", kvd.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(hit_and_check(&client, &requests[0], &src).await, 32);
    assert_eq!(kvd.metric("kvd_l1_disk_taken_back_total"), 32.0);
    assert_eq!(kvd.metric("kvd_disk_rejected_values_total"), 0.0);
}

/// A chunk the engine recomputed and stored again while the disk holds it (its prefix broke
/// before it at the lookup), or while it was being written, knows it is on disk: evicting it
/// again hands nothing to the write thread, whose reserve stays for chunks the disk lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_stored_again_while_on_disk_takes_no_page_and_none_of_the_write_reserve() {
    let dir = TempDir::new("disk-stored-again");
    // The write thread sleeps 500 ms each time it is handed chunks: long enough to store a
    // chunk again while it is being written and to see what the thread was handed.
    let kvd = kvd_one_disk(&dir.0, "fifo", &["--disk-inject-write-delay-ms", "500"]);
    let client = kvd.client("again").await;
    let kv = cache(7);
    let reg = kv.register(&client, FP, 0).await.unwrap();
    let written = || kvd.metric(r#"kvd_disk_evicted_chunks_total{outcome="written""#);
    let present = || kvd.metric(r#"kvd_disk_evicted_chunks_total{outcome="present""#);
    let handed = || kvd.metric("kvd_l1_disk_writing_bytes") / 4096.0;
    // 512 pages less a reserve of 64: 14 requests of 32 fill L1; the 15th evicts the first,
    // which is written.
    let requests: Vec<Vec<u128>> = (0..15).map(|r| hashes(r * 10_000, 32)).collect();
    for h in &requests {
        store(&client, &reg, h).await;
    }
    wait_evictions_settled(&kvd);
    assert_eq!(written(), 32.0, "log:\n{}", kvd.log());
    // Request 0 computed again (vLLM's prefix cache held it) and stored: the disk holds it, so
    // it is already stored and takes no L1 page: nothing is evicted, nothing handed to disk.
    let evictions = kvd.metric("kvd_evictions_total");
    store_expecting(&client, &reg, &requests[0], StoreOutcome::AlreadyStored).await;
    assert_eq!(
        kvd.metric("kvd_evictions_total"),
        evictions,
        "log:\n{}",
        kvd.log()
    );
    assert_eq!(handed(), 0.0, "log:\n{}", kvd.log());
    // A new request evicts request 1's chunks, handed to the write thread; request 1 is stored
    // again while it sleeps (the index has not got them yet: into L1 they go, evicting
    // request 2's).
    store(&client, &reg, &hashes(15 * 10_000, 32)).await;
    assert_eq!(handed(), 32.0, "log:\n{}", kvd.log());
    store(&client, &reg, &requests[1]).await;
    wait_evictions_settled(&kvd);
    assert_eq!(written(), 96.0, "log:\n{}", kvd.log());
    // Requests 3-14 leave (12 stores), then request 15, then request 1's second copy.
    for r in 16..29u32 {
        store(&client, &reg, &hashes(r * 10_000, 32)).await;
        wait_evictions_settled(&kvd);
    }
    assert_eq!(written(), 96.0 + 13.0 * 32.0, "log:\n{}", kvd.log());
    store(&client, &reg, &hashes(29 * 10_000, 32)).await;
    assert_eq!(
        handed(),
        0.0,
        "stored again during its write; log:\n{}",
        kvd.log()
    );
    wait_evictions_settled(&kvd);
    assert_eq!(written(), 96.0 + 13.0 * 32.0, "log:\n{}", kvd.log());
    // Counted as victims the disk held (published by the write thread when it next wakes).
    let deadline = Instant::now() + Duration::from_secs(10);
    while present() < 32.0 {
        assert!(Instant::now() < deadline, "log:\n{}", kvd.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(present(), 32.0);
    // And both come back from the disk, every byte right.
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();
    for h in &requests[..2] {
        assert_eq!(hit_and_check(&client, h, &src).await, 32);
    }
    assert_eq!(kvd.metric("kvd_disk_rejected_values_total"), 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_reads_back_from_disk_none_of_the_chunks_its_client_holds() {
    let dir = TempDir::new("disk-client-holds");
    let kvd = kvd_one_disk(&dir.0, "fifo", &[]);
    let client = kvd.client("holds").await;
    let kv = cache(7);
    let reg = kv.register(&client, FP, 0).await.unwrap();
    let filled = || kvd.metric(r#"kvd_disk_fill_chunks_total{outcome="filled""#);
    let client_holds = || kvd.metric(r#"kvd_disk_fill_chunks_total{outcome="client_holds""#);
    // 512 pages less a reserve of 64: 14 requests of 32 fill L1, the 15th and 16th evict the
    // first two, which are written to disk.
    let requests: Vec<Vec<u128>> = (0..16).map(|r| hashes(r * 10_000, 32)).collect();
    for h in &requests {
        store(&client, &reg, h).await;
        wait_evictions_settled(&kvd);
    }
    assert_eq!(
        kvd.metric(r#"kvd_disk_evicted_chunks_total{outcome="written""#),
        64.0,
        "log:\n{}",
        kvd.log()
    );
    let src: Vec<Vec<u8>> = (0..64).map(|b| kv.block_bytes(b)).collect();

    // vLLM's prefix cache holds request 0's first 20 chunks: the disk reads only the other 12,
    // and the 20 it holds count towards the hit unread.
    let hit = client.lookup(holding(20, &requests[0])).await.unwrap();
    assert_eq!(hit.hit_chunks, 32, "log:\n{}", kvd.log());
    assert_eq!(client_holds(), 20.0);
    // (The retrieve waits for the reads.)
    assert_eq!(
        retrieve_and_check(&client, &requests[0], 20..32, hit.pin_id, &src).await,
        12
    );
    assert_eq!(filled(), 12.0);

    // Where a chunk the client holds is kept neither on disk nor in L1 (chunk 5: never
    // stored), the hit ends there and nothing is read.
    let mut broken = requests[1].clone();
    broken[5] = 0xdead_beef;
    let hit = client.lookup(holding(20, &broken)).await.unwrap();
    assert_eq!((hit.hit_chunks, hit.pin_id), (5, 0), "log:\n{}", kvd.log());
    assert_eq!(filled(), 12.0);

    // A lookup from a client that holds nothing reads request 1 back whole, as before.
    assert_eq!(hit_and_check(&client, &requests[1], &src).await, 32);
    assert_eq!(filled(), 44.0);
    assert_eq!(kvd.metric("kvd_disk_rejected_values_total"), 0.0);
}
