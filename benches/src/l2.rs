//! `kvd-bench l2`: the L2 tier's throughput per kvd on loopback, against `redis-benchmark`
//! (or `valkey-benchmark`) with the same value size in the same run, and the latency of an L1
//! miss that hits L2, up to the data in the client's memory.
//!
//! One Valkey/Redis server (started here on a free port unless `--l2 redis://…` names one),
//! two kvd processes: A stores chunks (host memory standing in for GPU memory) and writes them
//! behind; the write figure is stored bytes over the time from the first store to the last
//! chunk written. B has an empty L1: a lookup of all the chunks fetches them from L2 into L1
//! (the read figure), then one-chunk lookup + retrieve of chunks B has never seen gives the
//! miss-to-client latency.
//!
//! Each chunk size runs twice in the same run: values checksummed (xxh3, the default) and values
//! MAC'd with a secret shared by both kvd processes (`--l2-secret-file`: keyed BLAKE3), so the
//! MAC's cost is read off two adjacent rows.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use kvd_proto::wire::*;

use crate::host_cache::{metric, HostCache};
use crate::Server;

/// Llama-3.1-8B-like TP8 shard in BLNHC: 32 layers, 1 KV head, K‖V 256, bf16, 16-token blocks:
/// 16 KiB per token.
const BYTES_PER_TOKEN: u64 = 32 * 256 * 2;
const REPS: usize = 3;

fn first_on_path(names: &[&'static str]) -> Option<&'static str> {
    names.iter().copied().find(|n| {
        Command::new(n)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// A redis-server started for the benchmark; killed on drop.
struct RedisChild(std::process::Child);

impl Drop for RedisChild {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis() -> Result<(RedisChild, u16)> {
    let bin = first_on_path(&["valkey-server", "redis-server"])
        .context("no valkey-server or redis-server: apt-get install redis-server, or pass --l2")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let child = Command::new(bin)
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no", "--dir", "/tmp"])
        .stdout(Stdio::null())
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        ensure!(Instant::now() < deadline, "redis-server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok((RedisChild(child), port))
}

/// `redis-benchmark -t set,get` at `value_bytes`: (set GB/s, get GB/s).
fn redis_benchmark(
    port: u16,
    value_bytes: u64,
    requests: usize,
    clients: usize,
) -> Result<(f64, f64)> {
    let bin = first_on_path(&["valkey-benchmark", "redis-benchmark"])
        .context("no valkey-benchmark or redis-benchmark: apt-get install redis-tools")?;
    let out = Command::new(bin)
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", "set,get"])
        .args(["-d", &value_bytes.to_string(), "-n", &requests.to_string()])
        .args(["-c", &clients.to_string(), "--csv"])
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let rps = |test: &str| -> Result<f64> {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("\"{test}\"")))
            .with_context(|| format!("no {test} row in redis-benchmark's output: {text}"))?;
        Ok(line
            .split(',')
            .nth(1)
            .context("rps")?
            .trim_matches('"')
            .parse()?)
    };
    let gbps = |rps: f64| rps * value_bytes as f64 / 1e9;
    Ok((gbps(rps("SET")?), gbps(rps("GET")?)))
}

/// Starts kvd and returns it with its HTTP address.
fn kvd(
    bin: &Path,
    url: &str,
    chunk_tokens: u64,
    pool_gib: f64,
    secret: Option<&Path>,
) -> Result<(Server, SocketAddr)> {
    let tokens = chunk_tokens.to_string();
    let pool = format!("{pool_gib:.2}");
    let mut args = vec![
        "--l2",
        url,
        "--chunk-tokens",
        &tokens,
        "--l1-size-gb",
        &pool,
        "--l2-deadline-ms",
        "10000",
    ];
    let secret = secret.map(|p| p.display().to_string());
    if let Some(s) = &secret {
        args.extend(["--l2-secret-file", s.as_str()]);
    }
    let server = Server::start(bin, &args)?;
    let http = server.http.context("kvd did not report its HTTP address")?;
    Ok((server, http))
}

/// Runs the benchmark and prints the table rows.
pub async fn run(bin: &Path, l2: Option<&str>, tokens: &[u64]) -> Result<()> {
    let (_redis, port, url) = match l2 {
        Some(url) => {
            let port = url
                .rsplit(':')
                .next()
                .and_then(|p| p.trim_end_matches('/').parse().ok())
                .context("--l2 redis://HOST:PORT")?;
            (None, port, url.to_string())
        }
        None => {
            let (child, port) = start_redis()?;
            (Some(child), port, format!("redis://127.0.0.1:{port}"))
        }
    };
    let secret = std::env::temp_dir().join(format!("kvd-bench-l2-{}.secret", std::process::id()));
    std::fs::write(
        &secret,
        "kvd-bench: a secret shared by both nodes, 32+ bytes\n",
    )?;
    println!("| chunk tokens | values | value MiB | chunks × reps | kvd write GB/s | redis-benchmark SET GB/s | write ratio | kvd read GB/s | redis-benchmark GET GB/s | read ratio | L1 miss → L2 → client p50 / max ms |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (&t, mac) in tokens.iter().flat_map(|t| [(t, false), (t, true)]) {
        let value = t * BYTES_PER_TOKEN;
        // About 256 MiB (at least 2 chunks) per repetition.
        let n = ((256u64 << 20) / value).max(2) as usize;
        // Room for two repetitions, and slabs (a sixteenth of a small pool) of at least one page.
        let pool_gib = ((2 * n as u64).max(16) * value) as f64 / (1u64 << 30) as f64 + 0.25;
        let blocks = (n as u64 * t / 16) as u32;
        let key = mac.then_some(secret.as_path());
        let (a, a_http) = kvd(bin, &url, t, pool_gib, key)?;
        let (b, b_http) = kvd(bin, &url, t, pool_gib, key)?;
        let ca = HostCache::register(
            &a.zmq,
            "bench-a",
            "kvd-bench-l2",
            0x12,
            0x9e37_79b9_7f4a_7c15,
            blocks,
        )
        .await?;
        let cb = HostCache::register(
            &b.zmq,
            "bench-b",
            "kvd-bench-l2",
            0x12,
            0x9e37_79b9_7f4a_7c15,
            blocks,
        )
        .await?;
        let (mut write_s, mut read_s) = (0.0, 0.0);
        let mut written = 0.0;
        for rep in 0..REPS {
            let hashes: Vec<u128> = (0..n as u128)
                .map(|i| (t as u128) << 64 | (rep as u128) << 32 | i)
                .collect();
            let t0 = Instant::now();
            let stored = ca
                .client
                .store(Store {
                    region: ca.region,
                    salt: 0,
                    chunks: ca.chunk_list(&hashes),
                    wait_slot: None,
                    deadline_ns: 0,
                })
                .await?;
            ensure!(
                stored.outcomes.iter().all(|o| *o == StoreOutcome::Stored),
                "store refused: {:?}",
                stored.outcomes
            );
            written += n as f64;
            while metric(a_http, "kvd_l2_write_behind_total{outcome=\"written\"")? < written {
                if metric(a_http, "kvd_l2_write_behind_total{outcome=\"failed\"")? > 0.0 {
                    bail!("write-behind failed; see kvd's log");
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            write_s += t0.elapsed().as_secs_f64();
            let t1 = Instant::now();
            let hit = cb.client.lookup(cb.lookup(&hashes)).await?;
            read_s += t1.elapsed().as_secs_f64();
            ensure!(
                hit.hit_chunks as usize == n,
                "B found {} of {n} chunks in L2",
                hit.hit_chunks
            );
            cb.client.release(Release { pin_id: hit.pin_id }).await?;
        }
        let bytes = (n * REPS) as f64 * value as f64;
        // Misses that hit L2: one chunk each, lookup + retrieve into the client's memory.
        let mut lat = Vec::new();
        for i in 0..8u128 {
            let h = [(t as u128) << 64 | 0xffff << 32 | i];
            ca.client
                .store(Store {
                    region: ca.region,
                    salt: 0,
                    chunks: ca.chunk_list(&h),
                    wait_slot: None,
                    deadline_ns: 0,
                })
                .await?;
            written += 1.0;
            while metric(a_http, "kvd_l2_write_behind_total{outcome=\"written\"")? < written {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            let t2 = Instant::now();
            let hit = cb.client.lookup(cb.lookup(&h)).await?;
            ensure!(hit.hit_chunks == 1, "miss not served from L2");
            let got = cb
                .client
                .retrieve(Retrieve {
                    region: cb.region,
                    salt: 0,
                    pin_id: hit.pin_id,
                    chunks: cb.chunk_list(&h),
                    wait_slot: None,
                    deadline_ns: 0,
                })
                .await?;
            ensure!(got.outcomes == vec![RetrieveOutcome::Loaded]);
            lat.push(t2.elapsed().as_secs_f64() * 1e3);
        }
        lat.sort_by(f64::total_cmp);
        ensure!(
            metric(b_http, "kvd_l2_rejected_values_total")? == 0.0,
            "values rejected"
        );
        drop((a, b));
        let (set, get) = redis_benchmark(port, value, (n * REPS).max(8), 4)?;
        let _ = Command::new(first_on_path(&["valkey-cli", "redis-cli"]).unwrap_or("redis-cli"))
            .args(["-p", &port.to_string(), "FLUSHALL"])
            .stdout(Stdio::null())
            .status();
        let (w, r) = (bytes / write_s / 1e9, bytes / read_s / 1e9);
        println!(
            "| {t} | {} | {} | {n} × {REPS} | {w:.2} | {set:.2} | {:.2} | {r:.2} | {get:.2} | {:.2} | {:.1} / {:.1} |",
            if mac { "MAC (BLAKE3)" } else { "xxh3" },
            value >> 20,
            w / set,
            r / get,
            lat[lat.len() / 2],
            lat[lat.len() - 1]
        );
    }
    let _ = std::fs::remove_file(&secret);
    Ok(())
}
