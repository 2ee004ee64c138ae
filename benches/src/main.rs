//! kvd benchmarks. Figures go to benches/RESULTS.md with the command, machine and date, each
//! next to a ceiling measured in the same run.
//!
//! - `control`: round trips/s and p50/p99 latency of ping (the ceiling), lookup, and a one-chunk
//!   store and retrieve on the host backend, with 1 and 64 requests in flight, against a real
//!   `kvd` process;
//! - `populate`: pool first-touch GB/s against thread count, next to the kernel populating
//!   the same size itself with MAP_POPULATE (the reference).
//!
//! - `l2`: the L2 tier's write and read GB/s per kvd on loopback next to `redis-benchmark` at
//!   the same value size, and the latency of an L1 miss served from L2 (see `l2.rs`).
//! - `disk`: the disk tier's write and read GB/s next to `fio` on the same file with the same
//!   block size and queue depth, and the lookup → L1 latency of one chunk (see `disk.rs`).
//!
//! The GPU data-plane benchmark is `benches/dataplane.py` (it needs PyTorch on the GPU host).
#![forbid(unsafe_code)]

mod disk;
mod host_cache;
mod l2;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvd_gpu::host::SharedMemory;
use kvd_gpu::PoolMemory;
use kvd_proto::client::{Client, ClientConfig};
use kvd_proto::layouts::vllm_layout;
use kvd_proto::wire::*;

fn usage() -> ! {
    eprintln!(
        "usage: kvd-bench control [--kvd PATH] [--seconds S]\n       kvd-bench populate [--gib G]\n       kvd-bench l2 [--kvd PATH] [--l2 redis://HOST:PORT] [--tokens 2048,8192]\n       kvd-bench disk [--kvd PATH] [--dir DIR] [--gib 2] [--tokens 2048] [--qd 32] [--io-kb 1024] [--baseline fio|dd] [--fio PATH] [--pool-gib 4]\n(the GPU data-plane benchmark is benches/dataplane.py)"
    );
    std::process::exit(2)
}

fn arg<'a>(args: &'a [String], name: &str) -> Option<&'a str> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let kvd = arg(&args, "--kvd")
        .map(PathBuf::from)
        .unwrap_or_else(default_kvd);
    match args.first().map(String::as_str) {
        Some("control") => {
            let secs: f64 = arg(&args, "--seconds").unwrap_or("3").parse()?;
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(control(&kvd, secs))
        }
        Some("populate") => populate(arg(&args, "--gib").unwrap_or("8").parse()?),
        Some("l2") => {
            let tokens = arg(&args, "--tokens")
                .unwrap_or("2048,8192")
                .split(',')
                .map(str::parse)
                .collect::<Result<Vec<u64>, _>>()?;
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(l2::run(&kvd, arg(&args, "--l2"), &tokens))
        }
        Some("disk") => {
            let o = disk::Opts {
                dir: PathBuf::from(arg(&args, "--dir").unwrap_or("/tmp/kvd-bench-disk")),
                gib: arg(&args, "--gib").unwrap_or("2").parse()?,
                tokens: arg(&args, "--tokens").unwrap_or("2048").parse()?,
                qd: arg(&args, "--qd").unwrap_or("32").parse()?,
                io_kb: arg(&args, "--io-kb").unwrap_or("1024").parse()?,
                baseline: match arg(&args, "--baseline").unwrap_or("fio") {
                    "fio" => disk::Baseline::Fio,
                    "dd" => disk::Baseline::Dd,
                    other => anyhow::bail!("--baseline {other}: fio or dd"),
                },
                fio: PathBuf::from(arg(&args, "--fio").unwrap_or("fio")),
                pool_gib: arg(&args, "--pool-gib").unwrap_or("4").parse()?,
            };
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?
                .block_on(disk::run(&kvd, &o))
        }
        _ => usage(),
    }
}

fn default_kvd() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    exe.with_file_name("kvd")
}

/// A kvd child process on free ports; stopped with SIGTERM on drop (so it removes its socket
/// files), its temp directory removed.
#[derive(Debug)]
pub struct Server {
    child: Child,
    /// ZMQ endpoint.
    pub zmq: String,
    /// HTTP address (/healthz, /metrics).
    pub http: Option<std::net::SocketAddr>,
    dir: PathBuf,
}

impl Server {
    /// kvd's CPU time so far, user and system, in seconds (`/proc/PID/stat`, clock ticks of
    /// 10 ms: the `process_cpu_seconds_total` metric counts whole seconds).
    pub fn cpu_seconds(&self) -> Result<(f64, f64)> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.child.id()))?;
        // Fields after the command name (which may hold spaces), from field 3 on.
        let rest = stat.rsplit_once(") ").context("/proc/PID/stat")?.1;
        let f: Vec<&str> = rest.split(' ').collect();
        let tick = |i: usize| -> Result<f64> {
            Ok(f.get(i).context("/proc/PID/stat")?.parse::<f64>()? / 100.0)
        };
        Ok((tick(11)?, tick(12)?))
    }

    /// kvd's CPU seconds so far (user + system) per thread name (`/proc/PID/task/*/stat`;
    /// threads of one name summed): which thread a phase kept busy.
    pub fn thread_cpu(&self) -> Result<std::collections::BTreeMap<String, f64>> {
        let mut out = std::collections::BTreeMap::new();
        for task in std::fs::read_dir(format!("/proc/{}/task", self.child.id()))? {
            // A thread may end between the listing and the read: skip it.
            let Ok(stat) = std::fs::read_to_string(task?.path().join("stat")) else {
                continue;
            };
            let (Some((head, rest)), Some(open)) = (stat.rsplit_once(") "), stat.find('(')) else {
                continue;
            };
            let f: Vec<&str> = rest.split(' ').collect();
            let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            *out.entry(head[open + 1..].to_string()).or_insert(0.0) +=
                (ticks(11) + ticks(12)) / 100.0;
        }
        Ok(out)
    }

    /// Starts `kvd serve` with `extra` flags and waits until it answers.
    pub fn start(kvd: &std::path::Path, extra: &[&str]) -> Result<Server> {
        use std::io::{BufRead, BufReader};
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvd-bench-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        let fd = dir.join("fd.sock");
        let mut child = Command::new(kvd)
            .args(["serve", "--port", "0", "--http-port", "0", "--fd-socket"])
            .arg(&fd)
            .args(extra)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", kvd.display()))?;
        let stderr = child.stderr.take().context("stderr")?;
        let mut zmq = None;
        let mut http = None;
        let mut lines = BufReader::new(stderr).lines();
        // What kvd said last, for the error when it exits without serving (a refused flag).
        let mut said = std::collections::VecDeque::new();
        while let Some(Ok(line)) = lines.next() {
            if said.len() == 4 {
                said.pop_front();
            }
            said.push_back(line.clone());
            if let Some(ep) = line.split("listening for clients on ").nth(1) {
                if ep.starts_with("tcp://") {
                    zmq = Some(ep.trim().to_string());
                }
            }
            if let Some(a) = line
                .split("serving /healthz and /metrics on http://")
                .nth(1)
            {
                http = a.trim().parse().ok();
            }
            if line.contains("L1 pool full") {
                break;
            }
            if line.contains("ERROR") {
                bail!("kvd failed: {line}");
            }
        }
        std::thread::spawn(move || for _ in lines {});
        let Some(zmq) = zmq else {
            let said: Vec<String> = said.into();
            bail!(
                "kvd exited or stopped before reporting its endpoint; it said: {}",
                said.join(" | ")
            );
        };
        Ok(Server {
            child,
            zmq,
            http,
            dir,
        })
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM lets kvd release its pool and unlink its fd socket; SIGKILL only if it hangs.
        let pid = rustix::process::Pid::from_child(&self.child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while matches!(self.child.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Latencies of one measurement.
#[derive(Debug)]
pub struct Sample {
    /// Requests completed.
    pub n: usize,
    /// Wall time.
    pub wall: Duration,
    /// Per-request latencies, sorted.
    pub lat: Vec<Duration>,
}

impl Sample {
    /// Requests per second.
    pub fn rate(&self) -> f64 {
        self.n as f64 / self.wall.as_secs_f64()
    }
    /// A latency percentile in microseconds.
    pub fn pct_us(&self, p: f64) -> f64 {
        if self.lat.is_empty() {
            return 0.0;
        }
        let i = ((self.lat.len() - 1) as f64 * p).round() as usize;
        self.lat[i].as_secs_f64() * 1e6
    }
}

async fn drive<F, Fut>(inflight: usize, secs: f64, op: F) -> Sample
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let op = Arc::new(op);
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..inflight {
        let op = op.clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut i = w as u64;
            while Instant::now() < deadline {
                let t = Instant::now();
                op(i).await;
                lat.push(t.elapsed());
                i += inflight as u64;
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap_or_default());
    }
    let wall = start.elapsed();
    lat.sort();
    Sample {
        n: lat.len(),
        wall,
        lat,
    }
}

/// Registers a host-memory (memfd) KV cache with kvd: the descriptor goes over the fd socket,
/// the layout over ZMQ.
pub async fn register_host(
    client: &Client,
    fingerprint: u64,
    shm: &SharedMemory,
    layout: KvLayout,
    layers: Vec<LayerPlacement>,
) -> Result<Registered> {
    let fd = rustix::io::fcntl_dupfd_cloexec(shm.fd(), 0)?;
    let token = client.share_fds(vec![fd]).await?;
    Ok(client
        .register(Register {
            fingerprint,
            shard: 0,
            device: DeviceSpec::Host,
            fd_token: token,
            allocations: vec![AllocationSpec::HostFd {
                fd_index: 0,
                size_bytes: shm.size_bytes(),
            }],
            layout,
            layers,
            client_events: vec![],
        })
        .await?)
}

async fn control(kvd: &std::path::Path, secs: f64) -> Result<()> {
    let server = Server::start(
        kvd,
        &[
            "--l1-size-gb",
            "2",
            "--chunk-tokens",
            "256",
            "--log-level",
            "info",
        ],
    )?;
    let mut cfg = ClientConfig::new(&server.zmq, "bench", Role::Tool);
    cfg.heartbeat = false;
    let client = Client::connect(cfg).await?;
    // Llama-3.1-8B-like TP8 shard in BLNHC: 32 layers, 1 KV head, head 128 (K‖V 256), bf16,
    // 16-token blocks: a 256-token chunk is a 4 MiB page.
    let (layout, layers, size) = vllm_layout("BLNHC", 32, 512, 1, 16, 256, 2)?;
    let shm = SharedMemory::create("kvd-bench", size)?;
    shm.write(0, &vec![7u8; size as usize])?;
    let reg = register_host(&client, 1, &shm, layout, layers).await?;
    let per = reg.chunk_blocks;
    // 16 stored chunks for lookups and retrieves.
    let stored: Vec<u128> = (1..=16).collect();
    client
        .store(Store {
            region: reg.region,
            salt: 0,
            chunks: stored
                .iter()
                .enumerate()
                .map(|(i, &h)| ChunkBlocks {
                    hash: h,
                    blocks: (0..per).map(|b| i as u32 * per + b).collect(),
                })
                .collect(),
            wait_slot: None,
            deadline_ns: 0,
        })
        .await?;
    // Pinned, so that the store phase's evictions cannot take them.
    let pin = client
        .lookup(Lookup {
            fingerprint: 1,
            salt: 0,
            shards: vec![0],
            hashes: stored.clone(),
            pin: true,
            readers: 1,
            held: 0,
        })
        .await?;
    anyhow::ensure!(pin.hit_chunks == 16, "setup stores missing");

    println!("| op | in flight | round trips/s | p50 µs | p99 µs | vs ping |");
    println!("|---|---|---|---|---|---|");
    for inflight in [1usize, 64] {
        let c = client.clone();
        let ping = drive(inflight, secs, move |_| {
            let c = c.clone();
            async move {
                c.ping(Ping {}).await.expect("ping");
            }
        })
        .await;
        let row = |name: &str, s: &Sample| {
            println!(
                "| {name} | {inflight} | {:.0} | {:.1} | {:.1} | {:.2} |",
                s.rate(),
                s.pct_us(0.5),
                s.pct_us(0.99),
                s.rate() / ping.rate()
            )
        };
        row("ping (ceiling)", &ping);
        let c = client.clone();
        let hashes = stored.clone();
        let lookup = drive(inflight, secs, move |_| {
            let c = c.clone();
            let hashes = hashes.clone();
            async move {
                let r = c
                    .lookup(Lookup {
                        fingerprint: 1,
                        salt: 0,
                        shards: vec![0],
                        hashes,
                        pin: false,
                        readers: 1,
                        held: 0,
                    })
                    .await
                    .expect("lookup");
                assert_eq!(r.hit_chunks, 16);
            }
        })
        .await;
        row("lookup, 16 chunks, hit", &lookup);
        // One-chunk store of a new key (evicting when the pool is full), 4 MiB copied.
        let c = client.clone();
        let region = reg.region;
        let store = drive(inflight, secs, move |i| {
            let c = c.clone();
            async move {
                let blocks = (0..per)
                    .map(|b| ((i as u32 % 16) * per + b) % 512)
                    .collect();
                c.store(Store {
                    region,
                    salt: 0,
                    chunks: vec![ChunkBlocks {
                        hash: 1 << 64 | (i as u128 + inflight as u128 * 1_000_000),
                        blocks,
                    }],
                    wait_slot: None,
                    deadline_ns: 0,
                })
                .await
                .expect("store");
            }
        })
        .await;
        row("store, 1 chunk (4 MiB)", &store);
        let c = client.clone();
        let retrieve = drive(inflight, secs, move |i| {
            let c = c.clone();
            async move {
                let blocks = (0..per)
                    .map(|b| 256 + ((i as u32 % 16) * per + b) % 256)
                    .collect();
                let r = c
                    .retrieve(Retrieve {
                        region,
                        salt: 0,
                        pin_id: 0,
                        chunks: vec![ChunkBlocks {
                            hash: 1 + (i as u128 % 16),
                            blocks,
                        }],
                        wait_slot: None,
                        deadline_ns: 0,
                    })
                    .await
                    .expect("retrieve");
                assert_eq!(r.outcomes[0], RetrieveOutcome::Loaded);
            }
        })
        .await;
        row("retrieve, 1 chunk (4 MiB)", &retrieve);
        let mb = |s: &Sample| s.rate() * 4.0 * 1.048576;
        eprintln!(
            "in flight {inflight}: store {:.0} MB/s, retrieve {:.0} MB/s",
            mb(&store),
            mb(&retrieve)
        );
    }
    Ok(())
}

fn populate(gib: f64) -> Result<()> {
    let bytes = (gib * (1u64 << 30) as f64) as u64;
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    // Warm-up: on VMs whose memory grows on first use (balloons, Firecracker), the first
    // touch of fresh guest memory costs far more than any later one; pay it once here.
    drop(
        memmap2::MmapOptions::new()
            .len(bytes as usize)
            .populate()
            .map_anon()?,
    );
    let t = Instant::now();
    let reference = memmap2::MmapOptions::new()
        .len(bytes as usize)
        .populate()
        .map_anon()?;
    let kernel = bytes as f64 / t.elapsed().as_secs_f64() / 1e9;
    drop(reference);
    println!("MAP_POPULATE of {gib} GiB (kernel, one thread): {kernel:.1} GB/s");
    println!("| threads | first touch GB/s | vs MAP_POPULATE |");
    println!("|---|---|---|");
    let mut threads = 1;
    while threads <= cpus {
        let mem = PoolMemory::allocate(kvd_gpu::PoolLayout::new(bytes, 2 << 20)?, true)?;
        let done = mem.first_touch(threads, Duration::from_secs(3600), &mut |_| {});
        println!(
            "| {threads} | {:.1} | {:.2} |",
            done.gb_per_s(),
            done.gb_per_s() / kernel
        );
        drop(mem);
        threads *= 2;
    }
    Ok(())
}
