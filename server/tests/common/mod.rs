//! The test kit: what every test would otherwise write again.
//!
//! - a kvd to test against: [`InProcess`], started in this process on port 0 (the default for
//!   tests that need no process of their own), or [`Kvd`], the real binary as a child on free
//!   ports (for signals, exit codes, logs, resource limits); both answer [`Running`]'s HTTP
//!   probes, metrics and clients;
//! - the chain of chunk keys clients compute ([`chain`]), and the ZMTP greeting for tests that
//!   speak ZMTP by hand ([`greeting`]);
//! - host-memory KV caches shaped like vLLM's ([`HostKv`]) and reproducible data ([`Rng`]);
//! - [`small`]: the small cache and chunk helpers the tier tests share; [`l2`] and
//!   [`redis_servers`]: L2 servers to test against.
#![allow(dead_code)]

pub mod in_process;
pub mod l2;
pub mod redis_servers;
pub mod small;

#[allow(unused_imports)]
pub use in_process::InProcess;
/// The ZMTP 3.1 greeting a DEALER sends (`greeting(false)`), for tests that speak ZMTP by hand.
#[allow(unused_imports)]
pub use kvd_proto::zmtp::codec::greeting;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use kvd_gpu::host::SharedMemory;
use kvd_proto::client::{Client, ClientConfig};
use kvd_proto::layouts::{flash_attn_v0_layout, vllm_layout};
use kvd_proto::wire::*;

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A private temp dir, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!(
            "kvd-{tag}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running kvd.
pub struct Kvd {
    pub child: Child,
    pub zmq: String,
    pub http: SocketAddr,
    pub fd_socket: PathBuf,
    pub ipc: Option<PathBuf>,
    pub log: Arc<Mutex<String>>,
    pub dir: TempDir,
}

/// The kvd binary: `$KVD_BIN` when set (test executables carried to another machine), else
/// the one cargo built.
pub fn kvd_bin() -> String {
    std::env::var("KVD_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvd").to_string())
}

impl Kvd {
    /// Starts kvd with a small pool and `extra` flags, and waits until it has bound its sockets.
    pub fn start(extra: &[&str]) -> Kvd {
        Kvd::start_with_open_files(extra, None)
    }

    /// Like [`Kvd::start`], under an open-file limit of `open_files` (soft and hard), the way a
    /// small container or a systemd unit would run it.
    pub fn start_with_open_files(extra: &[&str], open_files: Option<u64>) -> Kvd {
        Kvd::start_with(extra, open_files, &[])
    }

    /// Like [`Kvd::start`], with `env` added to its environment.
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Kvd {
        Kvd::start_with(extra, None, env)
    }

    fn start_with(extra: &[&str], open_files: Option<u64>, env: &[(&str, &str)]) -> Kvd {
        let dir = TempDir::new("srv");
        let fd_socket = dir.0.join("fd.sock");
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--port".into(),
            "0".into(),
            "--http-port".into(),
            "0".into(),
            "--fd-socket".into(),
            fd_socket.display().to_string(),
            "--log-level".into(),
            "info".into(),
        ];
        if !extra.contains(&"--l1-size-gb") {
            args.extend(["--l1-size-gb".into(), "0.25".into()]);
        }
        let ipc = extra
            .iter()
            .position(|a| *a == "--ipc")
            .map(|i| PathBuf::from(extra[i + 1]));
        args.extend(extra.iter().map(|s| s.to_string()));
        let mut command = match open_files {
            Some(n) => {
                let mut c = Command::new("sh");
                c.arg("-c")
                    .arg(format!("ulimit -n {n} && exec \"$0\" \"$@\""))
                    .arg(kvd_bin());
                c
            }
            None => Command::new(kvd_bin()),
        };
        let mut child = command
            .args(&args)
            .env_remove("TOTAL_CPU_DRAM_GB")
            .env_remove("KVD_L2_PASSWORD")
            .envs(env.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start kvd");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        // With KVD_TEST_LOG_DIR set, every kvd's log is also written there as it happens.
        let mut file = std::env::var_os("KVD_TEST_LOG_DIR").map(|d| {
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            std::fs::File::create(
                PathBuf::from(d).join(format!("kvd-{}-{n}.log", std::process::id())),
            )
            .unwrap()
        });
        {
            let log = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if let Some(f) = file.as_mut() {
                        let _ = writeln!(f, "{line}");
                    }
                    if let Some(ep) = line.split("listening for clients on ").nth(1) {
                        if ep.starts_with("tcp://") {
                            let _ = tx.send(("zmq", ep.trim().to_string()));
                        }
                    }
                    if let Some(a) = line
                        .split("serving /healthz and /metrics on http://")
                        .nth(1)
                    {
                        let _ = tx.send(("http", a.trim().to_string()));
                    }
                    let mut l = log.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
        }
        let (mut zmq, mut http) = (None, None);
        let deadline = Instant::now() + Duration::from_secs(20);
        while zmq.is_none() || http.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(("zmq", v)) => zmq = Some(v),
                Ok((_, v)) => http = Some(v.parse().unwrap()),
                Err(_) => panic!("kvd did not start; log:\n{}", log.lock().unwrap()),
            }
        }
        Kvd {
            child,
            zmq: zmq.unwrap(),
            http: http.unwrap(),
            fd_socket,
            ipc,
            log,
            dir,
        }
    }

    /// Starts kvd and waits for /healthz to answer 200 and for the whole pool to be ready, so
    /// that tests which fill the pool see all of it.
    pub fn ready(extra: &[&str]) -> Kvd {
        let k = Kvd::start(extra);
        k.wait_healthy(Duration::from_secs(30));
        k.wait_pool_full(Duration::from_secs(30));
        k
    }

    /// Sends SIGTERM and waits for the exit; returns the status and how long it took.
    pub fn terminate(&mut self) -> (ExitStatus, Duration) {
        let t = Instant::now();
        rustix::process::kill_process(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::TERM,
        )
        .unwrap();
        let deadline = t + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return (status, t.elapsed());
            }
            assert!(
                Instant::now() < deadline,
                "kvd did not exit within 10 s; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Running for Kvd {
    fn zmq_endpoint(&self) -> &str {
        &self.zmq
    }

    fn http_addr(&self) -> SocketAddr {
        self.http
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }
}

/// What tests ask of a running kvd, wherever it runs: its HTTP routes, metrics and clients.
pub trait Running {
    /// Its ZMQ endpoint (`tcp://HOST:PORT`).
    fn zmq_endpoint(&self) -> &str;
    /// Its HTTP address.
    fn http_addr(&self) -> SocketAddr;
    /// Its log so far, for failure messages.
    fn log(&self) -> String;

    /// A client of it, connected.
    fn client(&self, name: &str) -> impl std::future::Future<Output = Client> + Send {
        let zmq = self.zmq_endpoint().to_string();
        let name = name.to_string();
        async move {
            Client::connect(ClientConfig::new(&zmq, &name, Role::Tool))
                .await
                .expect("connect to kvd")
        }
    }

    /// The `pool` object of a 200 /healthz (ready and total bytes, state, growth rate).
    fn pool_status(&self) -> serde_json::Value {
        let (code, body) = self.get("/healthz");
        assert_eq!(code, 200, "healthz: {body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["pool"].clone()
    }

    /// Waits until /healthz reports the whole pool ready.
    fn wait_pool_full(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let pool = self.pool_status();
            if pool["state"] == "full" {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the pool did not fill: {pool}; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait_healthy(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            if let Ok((200, _)) = self.try_get("/healthz") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "kvd not healthy; log:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn try_get(&self, path: &str) -> std::io::Result<(u16, String)> {
        http_get(self.http_addr(), path)
    }

    fn get(&self, path: &str) -> (u16, String) {
        self.try_get(path).unwrap()
    }

    /// Sum of a metric's samples whose line starts with `prefix` (name plus optional labels).
    fn metric(&self, prefix: &str) -> f64 {
        let (code, body) = self.get("/metrics");
        assert_eq!(code, 200);
        body.lines()
            .filter(|l| !l.starts_with('#'))
            .filter(|l| {
                l.strip_prefix(prefix)
                    .is_some_and(|rest| rest.starts_with([' ', '{', ',', '}']))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }
}

impl Drop for Kvd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Stops a process (SIGSTOP) and returns once every one of its threads is stopped. kill()
/// returns sooner: the kernel wakes one thread to begin the group stop, and the others stop
/// only when it has run, so a request sent in that gap, on a busy machine, is answered.
pub fn stop_process(pid: u32) {
    use rustix::process::{kill_process, Pid, Signal};
    kill_process(Pid::from_raw(pid as i32).expect("a pid"), Signal::STOP).unwrap();
    let stopped = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("the process's threads")
            .flatten()
            .all(|t| {
                // The state follows the command name's closing parenthesis; a thread gone
                // meanwhile does not hold anything up.
                std::fs::read_to_string(t.path().join("stat")).map_or(true, |stat| {
                    stat.rsplit_once(')')
                        .and_then(|(_, rest)| rest.split_whitespace().next())
                        .is_some_and(|state| state == "T" || state == "t")
                })
            })
    };
    let until = Instant::now() + Duration::from_secs(5);
    while !stopped() {
        assert!(
            Instant::now() < until,
            "process {pid} did not stop within 5 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Raises this process's soft open-file limit to the hard one; returns the limit.
pub fn raise_open_files() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource};
    let mut lim = getrlimit(Resource::Nofile);
    lim.current = lim.maximum;
    setrlimit(Resource::Nofile, lim).expect("raise the open-file limit");
    lim.current.unwrap_or(u64::MAX)
}

/// Descriptors a process holds, from /proc.
pub fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// One GET over a fresh connection.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: kvd\r\n\r\n")?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    let code = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad response {out:?}")))?;
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    Ok((code, body))
}

/// xorshift64*: reproducible test data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for c in buf.chunks_mut(8) {
            let v = self.next().to_le_bytes();
            c.copy_from_slice(&v[..c.len()]);
        }
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A KV cache in host memory (memfds), shaped like vLLM's, that kvd maps as device memory.
pub struct HostKv {
    pub allocations: Vec<SharedMemory>,
    pub layout: KvLayout,
    pub layers: Vec<LayerPlacement>,
}

impl HostKv {
    /// A vLLM 0.33 cache: one buffer, per-layer `[blocks, heads, tokens, content]` views in
    /// physical order `order`.
    pub fn vllm(
        order: &str,
        layers: u32,
        blocks: u32,
        heads: u32,
        tokens: u32,
        content: u32,
        elem: u8,
    ) -> HostKv {
        let (layout, placements, size) =
            vllm_layout(order, layers, blocks, heads, tokens, content, elem).unwrap();
        HostKv {
            allocations: vec![SharedMemory::create("kvd-test-kv", size).unwrap()],
            layout,
            layers: placements,
        }
    }

    /// vLLM's FlashAttention layout before 0.33: one tensor per layer, `(2, blocks, tokens,
    /// heads, dim)`.
    pub fn flash_attn_v0(
        layers: u32,
        blocks: u32,
        tokens: u32,
        heads: u32,
        dim: u32,
        elem: u8,
    ) -> HostKv {
        let (layout, size) = flash_attn_v0_layout(blocks, tokens, heads, dim, elem);
        HostKv {
            allocations: (0..layers)
                .map(|_| SharedMemory::create("kvd-test-kv", size).unwrap())
                .collect(),
            layout,
            layers: (0..layers)
                .map(|l| LayerPlacement {
                    allocation: l as u16,
                    offset_bytes: 0,
                })
                .collect(),
        }
    }

    pub fn fill_random(&self, rng: &mut Rng) {
        for a in &self.allocations {
            let mut buf = vec![0u8; a.size_bytes() as usize];
            rng.fill(&mut buf);
            a.write(0, &buf).unwrap();
        }
    }

    /// Every byte of one block (all layers, planes, heads, tokens, content), in a fixed order.
    pub fn block_bytes(&self, block: u32) -> Vec<u8> {
        gather_block(&self.layout, &self.layers, block, &|alloc, off, len| {
            self.allocations[alloc as usize].read_vec(off, len).unwrap()
        })
    }

    /// Shares the memfds and registers the cache.
    pub async fn register(
        &self,
        client: &Client,
        fingerprint: u64,
        shard: u32,
    ) -> Result<Registered, kvd_proto::client::ClientError> {
        let fds: Vec<OwnedFd> = self
            .allocations
            .iter()
            .map(|a| rustix::io::fcntl_dupfd_cloexec(a.fd(), 0).unwrap())
            .collect();
        let token = client.share_fds(fds).await?;
        client
            .register(Register {
                fingerprint,
                shard,
                device: DeviceSpec::Host,
                fd_token: token,
                allocations: self
                    .allocations
                    .iter()
                    .enumerate()
                    .map(|(i, a)| AllocationSpec::HostFd {
                        fd_index: i as u32,
                        size_bytes: a.size_bytes(),
                    })
                    .collect(),
                layout: self.layout.clone(),
                layers: self.layers.clone(),
                client_events: vec![],
            })
            .await
    }
}

/// Every byte of one block of a cache described by `layout` and `layers`, in a fixed order
/// (layer, plane, head, token, content), read through `read(allocation, offset, len)` — computed
/// from the strides alone, independently of kvd's geometry code.
pub fn gather_block(
    layout: &KvLayout,
    layers: &[LayerPlacement],
    block: u32,
    read: &dyn Fn(u16, u64, usize) -> Vec<u8>,
) -> Vec<u8> {
    let l = layout;
    let e = l.elem_bytes as u64;
    let contiguous = l.content_stride_bytes == e;
    let mut out = Vec::new();
    for placement in layers {
        for plane in 0..l.kv_planes as u64 {
            for h in 0..l.heads as u64 {
                for t in 0..l.block_tokens as u64 {
                    let row = placement.offset_bytes
                        + block as u64 * l.block_stride_bytes
                        + plane * l.plane_stride_bytes
                        + h * l.head_stride_bytes
                        + t * l.token_stride_bytes;
                    if contiguous {
                        out.extend(read(
                            placement.allocation,
                            row,
                            (l.content as u64 * e) as usize,
                        ));
                    } else {
                        for c in 0..l.content as u64 {
                            out.extend(read(
                                placement.allocation,
                                row + c * l.content_stride_bytes,
                                e as usize,
                            ));
                        }
                    }
                }
            }
        }
    }
    out
}

/// The chain of chunk keys a client computes for a token sequence (kvd-proto's `keys`, which
/// the Python connector computes too), in chunks of `chunk` tokens.
pub fn chain(tokens: &[u32], chunk: usize) -> Vec<u128> {
    kvd_proto::keys::chunk_hashes(tokens, chunk, &[], 0)
}

/// The keys of `chunks` chunks of consecutive tokens from `first_token`.
pub fn chain_from(first_token: u32, chunks: usize, chunk: usize) -> Vec<u128> {
    let tokens: Vec<u32> = (first_token..first_token + (chunks * chunk) as u32).collect();
    chain(&tokens, chunk)
}

pub fn chunk(hash: u128, blocks: Vec<u32>) -> ChunkBlocks {
    ChunkBlocks { hash, blocks }
}

/// One chunk per hash, with the block ids at the same index.
pub fn chunks(hashes: &[u128], blocks: &[Vec<u32>]) -> Vec<ChunkBlocks> {
    assert_eq!(hashes.len(), blocks.len(), "one block list per hash");
    hashes
        .iter()
        .zip(blocks)
        .map(|(&h, b)| chunk(h, b.clone()))
        .collect()
}

/// Runs kvd with `args` until it exits (at most 20 s: a kvd that starts when it should have
/// refused is killed and the test fails); returns its exit code and stderr.
pub fn run(args: &[&str]) -> (i32, String) {
    let mut child = Command::new(kvd_bin())
        .args(args)
        .env_remove("TOTAL_CPU_DRAM_GB")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut err = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
            return (status.code().unwrap_or(-1), err);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kvd {args:?} kept running: it should have refused to start");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The one `kvd: ` line of a refused start.
pub fn fatal(err: &str) -> &str {
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("kvd: ")).collect();
    assert_eq!(
        lines.len(),
        1,
        "one line naming the flag and the fix: {err}"
    );
    lines[0]
}

/// `kvd serve` with a 10 MiB pool on free ports, then `extra`: the arguments for [`run`].
pub fn serve<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "serve",
        "--l1-size-gb",
        "0.01",
        "--port",
        "0",
        "--http-port",
        "0",
    ];
    a.extend_from_slice(extra);
    a
}
