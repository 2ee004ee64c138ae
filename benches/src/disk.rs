//! `kvd-bench disk`: the disk tier's write and read GB/s through kvd, against `fio` on the same
//! file with the same block size and queue depth in the same run, and the latency of a lookup
//! that brings one chunk from disk into L1.
//!
//! One kvd with an L1 of `--pool-gib` (4) and a disk tier on `--dir`: host memory stands in for
//! GPU memory.
//! - write: after L1 is full, every store evicts as much as it adds; the figure is the disk
//!   bytes kvd wrote over the time from the first measured store until the disk has taken
//!   everything evicted; each store waits until the pages of all but the last few stores'
//!   victims are released, as many as the tier's cap on pages waiting for the disk allows
//!   (so none is dropped), while those are written;
//! - read: loads of requests that are only on disk, one at a time, each request's chunks read
//!   together: the lookup (answered at once), then a retrieve that waits for the reads and
//!   skips every block (so no copy is timed); first enough of them to fill L1 with chunks the
//!   disk already holds (so that the measured fills evict without writing), then the measured
//!   ones;
//! - latency: the same for one chunk only on disk, lookup to the retrieve's reply (the chunk is
//!   then in L1, pinned, for the ordinary DMA);
//! - fio writes the whole file twice first (the first pass lays it out, so that the measured
//!   pass and kvd both write over allocated blocks), reads it after kvd, and writes it once
//!   more (kvd's write rate is compared with the mean of fio's passes before and after it),
//!   sequentially (`--ioengine=io_uring`, `--bs` = `--disk-io-kb`, `--iodepth` =
//!   `--disk-queue-depth`, `--direct` as kvd had it); `--fio PATH` names the executable (the
//!   static one scripts/build-fio.sh builds, for hosts without fio);
//! - which opcode kvd's I/Os used (`kvd_disk_ios_total`: fixed buffers or plain) and kvd's CPU
//!   seconds per GB in each phase, user and system (`/proc/PID/stat`; checksums included):
//!   where fixed buffers show (less system time) when the drive does not outrun the CPU.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kvd_proto::wire::*;

use crate::host_cache::{http_get, metric, HostCache};
use crate::Server;

/// Llama-3.1-8B-like TP8 shard in BLNHC (as `kvd-bench l2`): 16 KiB per token.
const BYTES_PER_TOKEN: u64 = 32 * 256 * 2;
/// Chunks per request (one lookup's worth).
const PER_REQUEST: usize = 4;
/// The `--disk-write-queue-mb` given to kvd: the pool bytes kept for the pages of evicted chunks
/// being written (kvd takes an eighth of the pool if that is less).
const WRITE_QUEUE_BYTES: u64 = 1 << 30;

/// Settings of one run.
#[derive(Debug, Clone)]
pub struct Opts {
    /// Directory for the disk file.
    pub dir: std::path::PathBuf,
    /// GiB stored through kvd.
    pub gib: f64,
    /// Tokens per chunk.
    pub tokens: u64,
    /// I/Os in flight per drive.
    pub qd: usize,
    /// KiB per I/O.
    pub io_kb: u64,
    /// What kvd is compared with.
    pub baseline: Baseline,
    /// The fio executable (`fio` on PATH unless given: scripts/device-disk.sh passes the
    /// static one it carries for hosts without fio).
    pub fio: std::path::PathBuf,
    /// L1 size, GiB. Its eighth (up to 1 GiB) is kvd's reserve of pages for evicted chunks being
    /// written, and so how many requests' writes the write phase keeps queued: one at 2 GiB,
    /// where each store's copy and the previous store's writes overlap only partly; three at
    /// the default 4 GiB; seven from 8 GiB (a production pool's 1 GiB).
    pub pool_gib: f64,
}

/// The tool that reads and writes the same file for comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Baseline {
    /// `fio --ioengine=io_uring` at kvd's block size and queue depth.
    Fio,
    /// `dd` with `O_DIRECT` at kvd's block size, one I/O in flight: for hosts without fio; a
    /// floor, not the drive's rate at depth.
    Dd,
}

fn request(tokens: u64, r: usize) -> Vec<u128> {
    (0..PER_REQUEST as u128)
        .map(|i| (tokens as u128) << 64 | (r as u128) << 32 | i)
        .collect()
}

/// Looks `hashes` up and waits until the hit is in L1, ready for the DMA: a lookup answers at
/// once while the disk reads, and a retrieve waits for the reads (here one that skips every
/// block, so nothing is copied and the time is the disk's alone). The chunks found in L1.
async fn load(c: &HostCache, hashes: &[u128]) -> Result<u32> {
    let hit = c.client.lookup(c.lookup(hashes)).await?;
    let n = hit.hit_chunks as usize;
    if n == 0 {
        return Ok(0);
    }
    let chunks = hashes[..n]
        .iter()
        .map(|&hash| ChunkBlocks {
            hash,
            blocks: vec![SKIP_BLOCK; c.per as usize],
        })
        .collect();
    let r = c
        .client
        .retrieve(Retrieve {
            region: c.region,
            salt: 0,
            pin_id: hit.pin_id,
            chunks,
            wait_slot: None,
            deadline_ns: 0,
        })
        .await?;
    c.client.release(Release { pin_id: hit.pin_id }).await?;
    Ok(r.outcomes
        .iter()
        .take_while(|&&o| o == RetrieveOutcome::Loaded)
        .count() as u32)
}

async fn store(c: &HostCache, hashes: &[u128]) -> Result<()> {
    let chunks = c.chunk_list(hashes);
    let r = c
        .client
        .store(Store {
            region: c.region,
            salt: 0,
            chunks,
            wait_slot: None,
            deadline_ns: 0,
        })
        .await?;
    ensure!(
        r.outcomes.iter().all(|o| *o == StoreOutcome::Stored),
        "store refused: {:?}",
        r.outcomes
    );
    Ok(())
}

/// Waits until at most `bytes` of L1's pages are still being written to disk, so that a store's
/// victims always find room in the tier's reserve and none is evicted unwritten.
async fn wait_writing_at_most(http: SocketAddr, bytes: u64) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while metric(http, "kvd_l1_disk_writing_bytes")? > bytes as f64 {
        ensure!(
            Instant::now() < deadline,
            "the disk tier stopped writing what L1 handed it"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    Ok(())
}

/// dd's bandwidth in bytes/s for `rw` (read, write) over the first `bytes` of `file`, in
/// `--io-kb` blocks with `O_DIRECT`, timed here.
fn dd(file: &Path, rw: &str, bytes: u64, o: &Opts, direct: bool) -> Result<f64> {
    let bs = o.io_kb * 1024;
    // Whole blocks, the last one past `bytes` if need be; the file is cut back to `bytes` after.
    let count = bytes.div_ceil(bs);
    let flag = if direct { "direct" } else { "fullblock" };
    let mut cmd = Command::new("dd");
    cmd.arg(format!("bs={bs}")).arg(format!("count={count}"));
    if rw == "write" {
        cmd.arg("if=/dev/zero")
            .arg(format!("of={}", file.display()))
            .arg(format!("oflag={flag}"))
            .arg("conv=notrunc");
    } else {
        cmd.arg(format!("if={}", file.display()))
            .arg("of=/dev/null")
            .arg(format!("iflag={flag}"));
    }
    let t = Instant::now();
    let out = cmd.output().context("running dd")?;
    let secs = t.elapsed().as_secs_f64();
    ensure!(
        out.status.success(),
        "dd failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    if rw == "write" {
        std::fs::OpenOptions::new()
            .write(true)
            .open(file)?
            .set_len(bytes)?;
    }
    Ok((count * bs) as f64 / secs)
}

/// The baseline's bandwidth in bytes/s for `rw` over the first `bytes` of `file`.
fn fio(file: &Path, rw: &str, bytes: u64, o: &Opts, direct: bool) -> Result<f64> {
    if o.baseline == Baseline::Dd {
        return dd(file, rw, bytes, o, direct);
    }
    let out = Command::new(&o.fio)
        .args(["--name=kvd", "--ioengine=io_uring", "--output-format=json"])
        .arg(format!("--filename={}", file.display()))
        .arg(format!("--rw={rw}"))
        .arg(format!("--bs={}k", o.io_kb))
        .arg(format!("--iodepth={}", o.qd))
        .arg(format!("--direct={}", u8::from(direct)))
        .arg(format!("--size={bytes}"))
        .output()
        .with_context(|| {
            format!(
                "running {}: apt-get install fio, or --fio PATH (scripts/build-fio.sh builds one)",
                o.fio.display()
            )
        })?;
    ensure!(
        out.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .with_context(|| format!("fio's JSON: {}", String::from_utf8_lossy(&out.stdout)))?;
    let dir = if rw.contains("write") {
        "write"
    } else {
        "read"
    };
    v["jobs"][0][dir]["bw_bytes"]
        .as_f64()
        .context("no bw_bytes in fio's output")
}

/// Runs the benchmark and prints the table row.
pub async fn run(bin: &Path, o: &Opts) -> Result<()> {
    let value = o.tokens * BYTES_PER_TOKEN;
    let per_request = PER_REQUEST as u64 * value;
    let n_requests = ((o.gib * (1u64 << 30) as f64) as u64 / per_request).max(8) as usize;
    let pool_bytes = (o.pool_gib * (1u64 << 30) as f64) as u64;
    let l1_requests = (pool_bytes / per_request) as usize + 1;
    // Requests' worth of L1 pages that may be being written at once: all but one of those the
    // tier's reserve holds (the next store's victims need a request's worth of it).
    let reserve_requests = (WRITE_QUEUE_BYTES.min(pool_bytes / 8) / per_request) as usize;
    if reserve_requests < 2 {
        // The reserve is an eighth of L1, at most WRITE_QUEUE_BYTES: past that no pool helps.
        let fix = if 2 * per_request > WRITE_QUEUE_BYTES {
            format!(
                "use --tokens {} or fewer",
                WRITE_QUEUE_BYTES / 2 / (PER_REQUEST as u64 * BYTES_PER_TOKEN)
            )
        } else {
            format!(
                "use --pool-gib {} or more, or fewer --tokens",
                (16 * per_request) as f64 / (1u64 << 30) as f64
            )
        };
        bail!(
            "--pool-gib {} --tokens {}: the disk tier's write reserve (an eighth of L1, at most {} \
             MiB) holds {reserve_requests} request(s) of {} MiB, and every store would drop its \
             victims unwritten; {fix}",
            o.pool_gib,
            o.tokens,
            WRITE_QUEUE_BYTES >> 20,
            per_request >> 20
        );
    }
    let ahead = reserve_requests - 1;
    std::fs::create_dir_all(&o.dir)?;
    let file = o.dir.join("kvd-bench.disk");
    let _ = std::fs::remove_file(&file);
    let mut index = file.clone().into_os_string();
    index.push(".index");
    let _ = std::fs::remove_file(&index);
    // Room for everything stored, so the log never comes round during the run.
    let disk_gib =
        (n_requests + 2 * l1_requests) as f64 * per_request as f64 / (1u64 << 30) as f64 + 0.25;
    let disk_gib = (disk_gib * 100.0).ceil() / 100.0;
    // kvd's size for it, to the byte, so kvd takes the file as fio left it.
    let disk_bytes = (disk_gib * (1u64 << 30) as f64) as u64 / 4096 * 4096;
    // fio writes the file first (with O_DIRECT: --dir must be on a filesystem that takes it).
    // The first pass lays the file out; the second, like kvd, writes over allocated blocks.
    fio(&file, "write", disk_bytes, o, true)?;
    let fio_w = fio(&file, "write", disk_bytes, o, true)?;
    let server = Server::start(
        bin,
        &[
            "--chunk-tokens",
            &o.tokens.to_string(),
            "--l1-size-gb",
            &o.pool_gib.to_string(),
            "--disk",
            &file.display().to_string(),
            // fio laid the file out: kvd may take it (the label makes it kvd's from then on).
            "--disk-overwrite",
            &file.display().to_string(),
            "--disk-size-gb",
            &format!("{disk_gib:.2}"),
            "--disk-queue-depth",
            &o.qd.to_string(),
            "--disk-io-kb",
            &o.io_kb.to_string(),
            "--disk-deadline-ms",
            "60000",
            "--disk-write-queue-mb",
            &(WRITE_QUEUE_BYTES >> 20).to_string(),
            // A policy that writes every victim: the default's admission writes only chunks it
            // expects to be read again, and these are stored once and never asked for (on
            // probation), so it would write none. This measures the drive's rates, not admission.
            "--eviction",
            "lru",
        ],
    )?;
    let http = server.http.context("kvd did not report its HTTP address")?;
    let health: serde_json::Value = {
        let body = http_get(http, "/healthz")?;
        serde_json::from_str(body.split("\r\n\r\n").nth(1).unwrap_or("{}"))?
    };
    let direct = health["disk"]["drives"][0]["direct"]
        .as_bool()
        .unwrap_or(false);
    let blocks = (PER_REQUEST as u64 * o.tokens / 16) as u32;
    let c = HostCache::register(
        &server.zmq,
        "bench-disk",
        "kvd-bench-disk",
        0xd1,
        0x2545_f491_4f6c_dd1d,
        blocks,
    )
    .await?;

    // Fill L1 (untimed), then store the measured requests, one ahead of the disk.
    for r in 0..l1_requests {
        store(&c, &request(o.tokens, r)).await?;
        wait_writing_at_most(http, 0).await?;
    }
    wait_writing_at_most(http, 0).await?;
    let w0 = metric(http, "kvd_disk_bytes_total{direction=\"write\"")?;
    let cpu0 = server.cpu_seconds()?;
    let threads0 = server.thread_cpu()?;
    let t0 = Instant::now();
    for r in l1_requests..l1_requests + n_requests {
        store(&c, &request(o.tokens, r)).await?;
        wait_writing_at_most(http, ahead as u64 * per_request).await?;
    }
    wait_writing_at_most(http, 0).await?;
    let write_s = t0.elapsed().as_secs_f64();
    let written = metric(http, "kvd_disk_bytes_total{direction=\"write\"")? - w0;
    let cpu1 = server.cpu_seconds()?;
    let write_cpu = (cpu1.0 - cpu0.0, cpu1.1 - cpu0.1);
    let mut write_threads = ThreadCpu::default();
    write_threads.add(&threads0, &server.thread_cpu()?, write_cpu.0 + write_cpu.1);
    let dropped = metric(
        http,
        "kvd_disk_evicted_chunks_total{outcome=\"dropped_busy\"",
    )?;

    // Reads: the first requests are only on disk now. Warm L1 with disk-backed chunks first.
    let on_disk = n_requests; // requests 0.. were all evicted and written
    ensure!(
        on_disk > l1_requests + 2,
        "store more (--gib) than the {} GiB L1",
        o.pool_gib
    );
    let mut read_s = 0.0;
    let mut read_bytes = 0.0;
    let mut read_cpu = (0.0, 0.0);
    let mut read_threads = ThreadCpu::default();
    for r in 0..on_disk {
        let h = request(o.tokens, r);
        let b0 = metric(http, "kvd_disk_bytes_total{direction=\"read\"")?;
        let c0 = server.cpu_seconds()?;
        let th0 = server.thread_cpu()?;
        let t = Instant::now();
        let loaded = load(&c, &h).await?;
        let took = t.elapsed().as_secs_f64();
        if loaded as usize != h.len() {
            let m = http_get(http, "/metrics")?;
            let disk: Vec<&str> = m
                .lines()
                .filter(|l| l.starts_with("kvd_disk") || l.starts_with("kvd_evictions"))
                .collect();
            bail!(
                "request {r}: {loaded} of {} chunks loaded from disk; kvd's disk metrics:\n{}",
                h.len(),
                disk.join("\n")
            );
        }
        wait_writing_at_most(http, 0).await?;
        if r >= l1_requests {
            read_s += took;
            read_bytes += metric(http, "kvd_disk_bytes_total{direction=\"read\"")? - b0;
            let c1 = server.cpu_seconds()?;
            read_cpu.0 += c1.0 - c0.0;
            read_cpu.1 += c1.1 - c0.1;
            read_threads.add(&th0, &server.thread_cpu()?, c1.0 - c0.0 + c1.1 - c0.1);
        }
    }
    // Latency: one chunk only on disk (read early above, evicted since).
    let mut lat = Vec::new();
    for r in 0..8 {
        let h = &request(o.tokens, r)[..1];
        let t = Instant::now();
        let loaded = load(&c, h).await?;
        lat.push(t.elapsed().as_secs_f64() * 1e3);
        ensure!(loaded == 1, "a one-chunk load from disk missed");
    }
    lat.sort_by(f64::total_cmp);
    // Which opcode kvd's I/Os used: fixed (the pool registered with io_uring) or plain.
    let mut ios = [0.0; 4];
    for (i, (dir, buf)) in [
        ("write", "fixed"),
        ("write", "plain"),
        ("read", "fixed"),
        ("read", "plain"),
    ]
    .iter()
    .enumerate()
    {
        ios[i] = metric(
            http,
            &format!("kvd_disk_ios_total{{buffer=\"{buf}\",direction=\"{dir}\""),
        )?;
    }
    let rejected = metric(http, "kvd_disk_rejected_values_total")?;
    if rejected > 0.0 {
        bail!("{rejected} values rejected; see kvd's log");
    }
    drop(c);
    drop(server);

    let span = (written as u64).max(read_bytes as u64);
    let fio_r = fio(&file, "read", span, o, direct)?;
    // fio writes again after kvd: on a shared disk its rate drifts from minute to minute, so
    // kvd is compared with the mean of the pass before and the pass after it.
    let fio_w_after = fio(&file, "write", disk_bytes, o, true)?;
    let fio_w_mean = (fio_w + fio_w_after) / 2.0;
    let (w, r) = (written / write_s, read_bytes / read_s);
    let b = match o.baseline {
        Baseline::Fio => "fio",
        Baseline::Dd => "dd (depth 1)",
    };
    println!("| L1 GiB | chunk MiB | I/O KiB × depth | O_DIRECT | kvd write GB/s | {b} write GB/s, before / after kvd | write ratio (to the mean) | kvd read GB/s | {b} read GB/s | read ratio | lookup → L1, one chunk, p50 / max ms | evicted chunks dropped |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {} × {} | {direct} | {:.2} | {:.2} / {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.1} / {:.1} | {dropped} |",
        o.pool_gib,
        value >> 20,
        o.io_kb,
        o.qd,
        w / 1e9,
        fio_w / 1e9,
        fio_w_after / 1e9,
        w / fio_w_mean,
        r / 1e9,
        fio_r / 1e9,
        r / fio_r,
        lat[lat.len() / 2],
        lat[lat.len() - 1]
    );
    // `as u64`: a sum of no lines is -0.0 (a kvd without the metric).
    println!(
        "kvd I/Os (kvd_disk_ios_total): write {} fixed / {} plain, read {} fixed / {} plain; \
         kvd CPU s per GB, user / system (checksums included): write {:.3} / {:.3}, read \
         {:.3} / {:.3}",
        ios[0] as u64,
        ios[1] as u64,
        ios[2] as u64,
        ios[3] as u64,
        write_cpu.0 / (written / 1e9),
        write_cpu.1 / (written / 1e9),
        read_cpu.0 / (read_bytes / 1e9),
        read_cpu.1 / (read_bytes / 1e9)
    );
    println!(
        "kvd's busiest threads, CPU seconds ÷ the phase's seconds (a thread near 1.00 bounds the \
         phase): write {}; read {}",
        write_threads.busiest(write_s),
        read_threads.busiest(read_s)
    );
    let _ = std::fs::remove_file(&file);
    let _ = std::fs::remove_file(&index);
    Ok(())
}

/// CPU seconds per kvd thread name, summed over a phase's intervals.
#[derive(Default)]
struct ThreadCpu(std::collections::BTreeMap<String, f64>);

impl ThreadCpu {
    /// Adds the CPU seconds between two snapshots; what the process used beyond its live
    /// threads' (`process` seconds in all) went to threads that ended in between — the
    /// disk tier's short-lived hashing threads — and is added as "(ended threads)".
    fn add(
        &mut self,
        before: &std::collections::BTreeMap<String, f64>,
        after: &std::collections::BTreeMap<String, f64>,
        process: f64,
    ) {
        let mut live = 0.0;
        for (name, &t) in after {
            let d = t - before.get(name).copied().unwrap_or(0.0);
            live += d;
            *self.0.entry(name.clone()).or_insert(0.0) += d;
        }
        *self.0.entry("(ended threads)".into()).or_insert(0.0) += (process - live).max(0.0);
    }

    /// The four busiest threads as `name share`, share = CPU seconds ÷ `wall` seconds.
    fn busiest(&self, wall: f64) -> String {
        let mut v: Vec<_> = self.0.iter().filter(|(_, &t)| t > 0.0).collect();
        v.sort_by(|a, b| b.1.total_cmp(a.1));
        v.iter()
            .take(4)
            .map(|(n, t)| format!("{n} {:.2}", *t / wall))
            .collect::<Vec<_>>()
            .join(", ")
    }
}
