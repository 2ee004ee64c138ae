//! `kvd serve` flags, their defaults, and the checks that turn bad values into one line naming
//! the flag and the fix.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use kvd_gpu::PoolLayout;

use crate::control::fdpass::FdLimits;
use crate::l1::evict::PolicyKind;
use crate::l1::numa::{NumaMode, Topology};
use crate::tiers::disk::config::{DiskArgs, DiskConfig};
use crate::tiers::l2::config::{L2Args, L2Config, Secret, PASSWORD_ENV};

const GIB: f64 = (1u64 << 30) as f64;
const MIB: u64 = 1 << 20;

/// kvd: a native KV-cache offload server for vLLM.
#[derive(Debug, Parser)]
// A flag given twice takes its last value, so a systemd unit's or a container's extra arguments
// override the defaults they come after.
#[command(name = "kvd", version, about, long_about = None, args_override_self = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the server.
    Serve(ServeArgs),
}

/// Flags of `kvd serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// L1 pool size in GiB (fractions allowed). Default: 75% of TOTAL_CPU_DRAM_GB when that
    /// variable is set, else 75% of physical memory (or of the cgroup memory limit if lower).
    #[arg(long, value_name = "GIB", allow_negative_numbers = true)]
    pub l1_size_gb: Option<f64>,
    /// Address of the ZMQ (tcp) endpoint.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port of the ZMQ (tcp) endpoint; 0 picks a free one.
    #[arg(long, default_value_t = 5555, allow_negative_numbers = true)]
    pub port: u16,
    /// Also listen on ipc://PATH (a stale socket file there is removed first).
    #[arg(long, value_name = "PATH")]
    pub ipc: Option<PathBuf>,
    /// Address of the HTTP endpoint (/healthz, /metrics).
    #[arg(long, default_value = "127.0.0.1")]
    pub http_host: String,
    /// Port of the HTTP endpoint; 0 picks a free one.
    #[arg(long, default_value_t = 8080, allow_negative_numbers = true)]
    pub http_port: u16,
    /// Tokens per chunk: the unit of keys and of pool pages. Must be a multiple of every
    /// registered cache's block size.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true)]
    pub chunk_tokens: u32,
    /// Eviction policy: prefix-reuse (default: prefix-aware with reuse distances; on the agentic
    /// traces it hit more chunks than s3fifo and lru on both halves, benches/RESULTS.md),
    /// prefix, s3fifo, lru or fifo.
    #[arg(long, default_value = "prefix-reuse", value_name = "POLICY")]
    pub eviction: String,
    /// Log filter: error, warn, info, debug, trace, or a tracing filter such as
    /// `kvd_server=debug`.
    #[arg(long, default_value = "info", value_name = "FILTER")]
    pub log_level: String,
    /// Log format: text (for people) or json (one object per line, for log shippers).
    #[arg(long, default_value = "text", value_name = "FORMAT")]
    pub log_format: String,
    /// Unix socket on which clients share file descriptors (host memory, CUDA VMM memory).
    /// Default: kvd-PORT.fd.sock (kvd-pidPID.fd.sock with --port 0) in $XDG_RUNTIME_DIR, else
    /// in /tmp.
    #[arg(long, value_name = "PATH")]
    pub fd_socket: Option<PathBuf>,
    /// Share of the pool's pages (percent) that lookup pins may hold; past it a lookup pins the
    /// head of its hit that fits and reports the rest unpinned, so stores find pages. 100: pins
    /// bounded only by the pool.
    #[arg(long, default_value_t = 50, value_name = "PCT")]
    pub lookup_pin_pct: u8,
    /// Share of the pool's pages (percent) that lookup holds may cover: the chunks a lookup
    /// reports past the pins' share are held until their retrieve, evicted only when nothing
    /// else can be. 0: no holds.
    #[arg(long, default_value_t = 50, value_name = "PCT")]
    pub lookup_hold_pct: u8,
    /// How long a lookup hold lasts without a retrieve. 0: no holds.
    #[arg(long, default_value_t = 10_000, value_name = "MS")]
    pub lookup_hold_ms: u64,
    /// How long a lookup's pin holds chunks that are not retrieved or released.
    #[arg(
        long,
        default_value_t = 120_000,
        value_name = "MS",
        allow_negative_numbers = true
    )]
    pub pin_timeout_ms: u64,
    /// A client silent for this long is dropped and its pins and registrations released.
    #[arg(
        long,
        default_value_t = 30_000,
        value_name = "MS",
        allow_negative_numbers = true
    )]
    pub session_timeout_ms: u64,
    /// Slab size: pages of one size are carved from slabs of this many MiB (lowered
    /// automatically for small pools).
    #[arg(
        long,
        default_value_t = 256,
        value_name = "MIB",
        allow_negative_numbers = true
    )]
    pub slab_mb: u64,
    /// Threads that first-touch the pool. Default: the number of CPUs, at most 64.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub populate_threads: Option<usize>,
    /// Copy jobs queued per device before requests are refused as busy.
    #[arg(
        long,
        default_value_t = 1024,
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub copy_queue: usize,
    /// Largest request frame accepted, in MiB.
    #[arg(
        long,
        default_value_t = 4,
        value_name = "MIB",
        allow_negative_numbers = true
    )]
    pub max_frame_mb: usize,
    /// Do not ask for transparent huge pages for the pool.
    #[arg(long)]
    pub no_hugepages: bool,
    /// Most ZMQ connections at once. Default: a quarter of the open-file limit, at most 4096.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub max_connections: Option<usize>,
    /// Time a new ZMQ connection has to say hello before it is closed.
    #[arg(
        long,
        default_value_t = 3000,
        value_name = "MS",
        allow_negative_numbers = true
    )]
    pub hello_timeout_ms: u64,
    /// Requests per connection read and not yet answered; further ones wait in the client's
    /// socket, so one client cannot fill the control loop.
    #[arg(
        long,
        default_value_t = 8,
        value_name = "N",
        allow_negative_numbers = true
    )]
    pub max_in_flight: usize,
    /// MiB of received, not yet answered request bytes across all connections.
    #[arg(
        long,
        default_value_t = 256,
        value_name = "MIB",
        allow_negative_numbers = true
    )]
    pub max_buffered_mb: usize,
    /// Permission bits of the fd socket (octal): who may connect and share descriptors.
    #[arg(long, default_value = "0660", value_name = "MODE")]
    pub fd_socket_mode: String,
    /// Most fd-socket connections at once (half of them for a user other than kvd's). Default: a sixteenth of the
    /// open-file limit, at most 256.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub fd_max_connections: Option<usize>,
    /// Most unclaimed shared descriptors held at once (half of them for a user other than kvd's). Default: what
    /// the open-file limit leaves after connections and 128 spare, at most 262144.
    #[arg(long, value_name = "N", allow_negative_numbers = true)]
    pub fd_max_stashed: Option<usize>,
    /// An fd-socket connection that sends nothing for this long is closed.
    #[arg(
        long,
        default_value_t = 10_000,
        value_name = "MS",
        allow_negative_numbers = true
    )]
    pub fd_idle_timeout_ms: u64,
    /// NUMA placement where the machine has several nodes: auto (each GPU's copies use pool
    /// memory and CPUs on its own node), off (the kernel places the pool), or remote (each
    /// GPU's stores use another node's memory: only to measure what placement is worth).
    #[arg(long, default_value = "auto", value_name = "MODE")]
    pub numa: String,
    /// The L2 tier.
    #[command(flatten)]
    pub l2: L2Args,
    /// The removal feed.
    #[command(flatten)]
    pub events: crate::l1::events::FeedArgs,
    /// The disk tier.
    #[command(flatten)]
    pub disk: DiskArgs,
}

/// Descriptors kept free for listeners, HTTP connections, the pool, logs and the GPU driver.
pub const SPARE_FDS: usize = 128;
/// Most first-touch threads.
pub const MAX_POPULATE_THREADS: usize = 1024;

/// How the pool size was chosen.
#[derive(Debug, Clone, PartialEq)]
pub enum SizeRule {
    /// `--l1-size-gb`.
    Flag,
    /// 75% of `TOTAL_CPU_DRAM_GB`.
    TotalCpuDramGb(f64),
    /// 75% of physical memory.
    Physical(u64),
    /// 75% of the cgroup memory limit in the file named, below physical memory.
    Cgroup(u64, PathBuf),
}

impl std::fmt::Display for SizeRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SizeRule::Flag => write!(f, "--l1-size-gb"),
            SizeRule::TotalCpuDramGb(gb) => write!(f, "75% of TOTAL_CPU_DRAM_GB={gb}"),
            SizeRule::Physical(b) => write!(f, "75% of {:.1} GiB of memory", *b as f64 / GIB),
            SizeRule::Cgroup(b, file) => write!(
                f,
                "75% of the cgroup memory limit of {:.1} GiB in {}",
                *b as f64 / GIB,
                file.display()
            ),
        }
    }
}

/// Validated settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Pool size and slab (pinned piece) size: whole slabs only.
    pub layout: PoolLayout,
    /// Why that size.
    pub size_rule: SizeRule,
    /// ZMQ tcp address.
    pub host: String,
    /// ZMQ tcp port.
    pub port: u16,
    /// Extra ipc endpoint.
    pub ipc: Option<PathBuf>,
    /// HTTP address.
    pub http_host: String,
    /// HTTP port.
    pub http_port: u16,
    /// Tokens per chunk.
    pub chunk_tokens: u32,
    /// Eviction policy.
    pub eviction: PolicyKind,
    /// Log filter.
    pub log_level: String,
    /// Log format.
    pub log_format: LogFormat,
    /// fd socket path.
    pub fd_socket: PathBuf,
    /// Pin timeout.
    pub pin_timeout: Duration,
    /// Share of the pool's pages lookup pins may hold (0..=1).
    pub lookup_pin_frac: f64,
    /// Share of the pool's pages lookup holds may cover (0..=1).
    pub lookup_hold_frac: f64,
    /// How long a lookup hold lasts.
    pub lookup_hold: Duration,
    /// Session timeout.
    pub session_timeout: Duration,
    /// First-touch threads.
    pub populate_threads: usize,
    /// Copy queue depth per device.
    pub copy_queue: usize,
    /// Largest frame.
    pub max_frame_bytes: usize,
    /// Hugepage advice.
    pub hugepages: bool,
    /// Most ZMQ connections.
    pub max_connections: usize,
    /// Hello deadline of a new connection.
    pub hello_timeout: Duration,
    /// Requests in flight per connection.
    pub max_in_flight: usize,
    /// Received, unanswered request bytes across connections.
    pub max_buffered_bytes: usize,
    /// fd socket permission bits.
    pub fd_socket_mode: u32,
    /// fd socket limits.
    pub fd_limits: FdLimits,
    /// NUMA nodes, for pool placement and copy-thread affinity.
    pub topology: Topology,
    /// NUMA placement mode.
    pub numa: NumaMode,
    /// The L2 tier, if any.
    pub l2: Option<L2Config>,
    /// Records the removal feed keeps.
    pub events_capacity: usize,
    /// The disk tier, if any.
    pub disk: Option<DiskConfig>,
}

/// How kvd writes its log (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// A bad setting: one line naming the flag and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// Checks that flag `flag`'s `value` lies in `range`; otherwise the one-line error is
/// `{flag} {value}: {fix}`, `fix` saying what to pass instead. Every flag with a range goes
/// through here, so that each error names the flag and the value the same way.
pub fn check_flag<T: PartialOrd + std::fmt::Display>(
    flag: &str,
    value: T,
    range: impl std::ops::RangeBounds<T>,
    fix: &str,
) -> Result<(), ConfigError> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(ConfigError(format!("{flag} {value}: {fix}")))
    }
}

/// What the machine offers; read once at start, injected in tests.
#[derive(Debug, Clone)]
pub struct Machine {
    /// Physical memory, or the cgroup limit if lower.
    pub memory_bytes: u64,
    /// The cgroup limit's file, when `memory_bytes` came from one.
    pub cgroup_limit: Option<PathBuf>,
    /// `KVD_L2_PASSWORD`, if set.
    pub l2_password_env: Option<Secret>,
    /// `TOTAL_CPU_DRAM_GB`, if set.
    pub total_cpu_dram_gb: Option<String>,
    /// CPUs available.
    pub cpus: usize,
    /// `XDG_RUNTIME_DIR`, if set.
    pub runtime_dir: Option<PathBuf>,
    /// The open-file limit kvd runs under (it raises its soft limit to the hard one first).
    pub open_files: usize,
    /// kvd's effective user id.
    pub euid: u32,
    /// NUMA nodes and their CPUs, from sysfs.
    pub topology: Topology,
}

impl Machine {
    /// Reads /proc/meminfo, the cgroup limit and the environment.
    pub fn probe() -> Machine {
        let physical = read_meminfo_total().unwrap_or(0);
        let (memory_bytes, cgroup_limit) = match crate::ops::cgroup::memory_limit(Path::new("/")) {
            Some(limit) if limit.bytes < physical || physical == 0 => {
                (limit.bytes, Some(limit.file))
            }
            _ => (physical, None),
        };
        Machine {
            memory_bytes,
            cgroup_limit,
            l2_password_env: std::env::var(PASSWORD_ENV)
                .ok()
                .filter(|p| !p.is_empty())
                .map(Secret::new),
            total_cpu_dram_gb: std::env::var("TOTAL_CPU_DRAM_GB").ok(),
            cpus: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            runtime_dir: std::env::var_os("XDG_RUNTIME_DIR").map(PathBuf::from),
            open_files: rustix::process::getrlimit(rustix::process::Resource::Nofile)
                .current
                .map_or(usize::MAX, |n| usize::try_from(n).unwrap_or(usize::MAX)),
            euid: rustix::process::geteuid().as_raw(),
            topology: Topology::read(std::path::Path::new("/sys")),
        }
    }
}

fn read_meminfo_total() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Whether two listen addresses can be the same socket: equal, or one of them every address.
fn hosts_overlap(a: &str, b: &str) -> bool {
    let norm = |h: &str| match h.trim_matches(|c| c == '[' || c == ']') {
        "localhost" => "127.0.0.1".to_string(),
        h => h.to_string(),
    };
    let wild = |h: &str| matches!(h, "" | "0.0.0.0" | "::" | "*");
    let (a, b) = (norm(a), norm(b));
    a == b || wild(&a) || wild(&b)
}

/// Two of kvd's own listeners on one port or one socket path: refused before binding, naming
/// both flags (binding would fail on the second and blame "another process").
fn check_collisions(a: &ServeArgs, fd_socket: &Path) -> Result<(), ConfigError> {
    if a.port != 0 && a.port == a.http_port && hosts_overlap(&a.host, &a.http_host) {
        return Err(ConfigError(format!(
            "--port {} and --http-port {}: kvd cannot listen on one port twice; give them \
             different ports (defaults: 5555 and 8080)",
            a.port, a.http_port
        )));
    }
    if let Some(ipc) = &a.ipc {
        let same = match (std::path::absolute(ipc), std::path::absolute(fd_socket)) {
            (Ok(x), Ok(y)) => x == y,
            _ => ipc == fd_socket,
        };
        if same {
            return Err(ConfigError(format!(
                "--ipc {} and --fd-socket {}: kvd cannot listen on one socket path twice; give \
                 them different paths",
                ipc.display(),
                fd_socket.display()
            )));
        }
    }
    Ok(())
}

/// A log filter is a comma-separated list of directives; a bare word must be a level (a
/// target alone, such as `verbose`, would silently switch off everything else).
fn log_filter_is_valid(filter: &str) -> bool {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    tracing_subscriber::EnvFilter::try_new(filter).is_ok()
        && filter.split(',').map(str::trim).all(|d| {
            d.contains('=') || d.contains('[') || LEVELS.contains(&d.to_ascii_lowercase().as_str())
        })
}

fn gib(bytes: u64) -> String {
    format!("{:.1} GiB", bytes as f64 / GIB)
}

impl ServeArgs {
    /// Checks every flag against the machine and resolves the defaults.
    pub fn resolve(&self, machine: &Machine) -> Result<Config, ConfigError> {
        let memory_what = if machine.cgroup_limit.is_some() {
            format!("the cgroup memory limit of {}", gib(machine.memory_bytes))
        } else {
            format!("this machine's {} of memory", gib(machine.memory_bytes))
        };
        let (pool_bytes, size_rule) = match (self.l1_size_gb, &machine.total_cpu_dram_gb) {
            (Some(gb), _) => {
                if !gb.is_finite() || gb <= 0.0 {
                    return Err(ConfigError(format!(
                        "--l1-size-gb {gb}: the pool size must be a positive number of GiB, e.g. --l1-size-gb 64"
                    )));
                }
                let bytes = (gb * GIB) as u64;
                if machine.memory_bytes > 0 && bytes > machine.memory_bytes {
                    return Err(ConfigError(format!(
                        "--l1-size-gb {gb}: above {memory_what}; pass at most {:.1}",
                        machine.memory_bytes as f64 / GIB
                    )));
                }
                (bytes, SizeRule::Flag)
            }
            (None, Some(total)) => {
                let gb: f64 = total.trim().parse().ok().filter(|g: &f64| g.is_finite() && *g > 0.0).ok_or_else(|| {
                    ConfigError(format!(
                        "TOTAL_CPU_DRAM_GB={total:?} is not a positive number of GiB; fix or unset it, or pass --l1-size-gb"
                    ))
                })?;
                let bytes = (gb * 0.75 * GIB) as u64;
                if machine.memory_bytes > 0 && bytes > machine.memory_bytes {
                    return Err(ConfigError(format!(
                        "TOTAL_CPU_DRAM_GB={total}: 75% of it is above {memory_what}; fix the variable or pass --l1-size-gb"
                    )));
                }
                (bytes, SizeRule::TotalCpuDramGb(gb))
            }
            (None, None) => {
                if machine.memory_bytes == 0 {
                    return Err(ConfigError(
                        "cannot read this machine's memory size from /proc/meminfo; pass --l1-size-gb".into(),
                    ));
                }
                (
                    machine.memory_bytes / 4 * 3,
                    match &machine.cgroup_limit {
                        Some(file) => SizeRule::Cgroup(machine.memory_bytes, file.clone()),
                        None => SizeRule::Physical(machine.memory_bytes),
                    },
                )
            }
        };

        check_flag(
            "--slab-mb",
            self.slab_mb,
            2..,
            "slabs must be at least 2 MiB, e.g. --slab-mb 256",
        )?;
        // Small pools get smaller slabs, so that a test pool of a few hundred MiB still holds
        // several page sizes; never below 2 MiB, the huge page size.
        let wanted = self.slab_mb * MIB;
        let auto = (pool_bytes / 16) / (2 * MIB) * (2 * MIB);
        let slab_bytes = wanted.min(auto.max(2 * MIB));
        if pool_bytes < slab_bytes {
            return Err(ConfigError(format!(
                "pool of {pool_bytes} bytes is smaller than one {slab_bytes}-byte slab; pass a larger --l1-size-gb (at least 0.002)"
            )));
        }
        // The tail that does not fill a slab is never mapped.
        let layout = PoolLayout::new(pool_bytes, slab_bytes)
            .map_err(|e| ConfigError(format!("--l1-size-gb/--slab-mb: {e}")))?;

        check_flag(
            "--chunk-tokens",
            self.chunk_tokens,
            1..,
            "a chunk needs at least one block of tokens, e.g. --chunk-tokens 256",
        )?;
        let eviction: PolicyKind = self.eviction.parse().map_err(|_| {
            ConfigError(format!(
                "--eviction {}: unknown policy; use one of: {}",
                self.eviction,
                PolicyKind::NAMES.join(", ")
            ))
        })?;
        if !log_filter_is_valid(&self.log_level) {
            return Err(ConfigError(format!(
                "--log-level {}: not a log filter; use error, warn, info, debug or trace",
                self.log_level
            )));
        }
        let log_format = match self.log_format.as_str() {
            "text" => LogFormat::Text,
            "json" => LogFormat::Json,
            other => {
                return Err(ConfigError(format!(
                    "--log-format {other}: use text or json"
                )))
            }
        };
        check_flag(
            "--lookup-pin-pct",
            self.lookup_pin_pct,
            1..=100,
            "must be 1 to 100; use e.g. 50",
        )?;
        check_flag(
            "--lookup-hold-pct",
            self.lookup_hold_pct,
            0..=100,
            "must be 0 (no holds) to 100; use e.g. 50",
        )?;
        check_flag(
            "--pin-timeout-ms",
            self.pin_timeout_ms,
            1..,
            "pins would end at once; use e.g. 120000",
        )?;
        check_flag(
            "--session-timeout-ms",
            self.session_timeout_ms,
            1000..,
            "too short for clients to ping in time; use at least 1000",
        )?;
        check_flag(
            "--copy-queue",
            self.copy_queue,
            1..,
            "need room for at least one job, e.g. 1024",
        )?;
        check_flag(
            "--max-frame-mb",
            self.max_frame_mb,
            1..=1024,
            "use a value from 1 to 1024",
        )?;
        if let Some(n) = self.populate_threads {
            check_flag(
                "--populate-threads",
                n,
                1..=MAX_POPULATE_THREADS,
                &format!(
                    "use 1 to {MAX_POPULATE_THREADS} (default: the number of CPUs, at most 64)"
                ),
            )?;
        }
        check_flag(
            "--hello-timeout-ms",
            self.hello_timeout_ms,
            100..,
            "clients need time to say hello; use at least 100",
        )?;
        check_flag(
            "--max-in-flight",
            self.max_in_flight,
            1..=4096,
            "use 1 to 4096, e.g. 8",
        )?;
        let max_frame_bytes = self.max_frame_mb * MIB as usize;
        check_flag(
            "--max-buffered-mb",
            self.max_buffered_mb,
            self.max_frame_mb..=1 << 20,
            &format!(
                "must hold one whole frame (--max-frame-mb {}) and be at most 1048576",
                self.max_frame_mb
            ),
        )?;
        let fd_socket_mode = u32::from_str_radix(self.fd_socket_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777 && m & 0o600 == 0o600)
            .ok_or_else(|| {
                ConfigError(format!(
                    "--fd-socket-mode {}: use octal permission bits that include 0600, e.g. 0660 (owner and group) or 0666 (every local user)",
                    self.fd_socket_mode
                ))
            })?;
        check_flag(
            "--fd-idle-timeout-ms",
            self.fd_idle_timeout_ms,
            100..,
            "clients need time to send; use at least 100",
        )?;
        for (flag, v) in [
            ("--max-connections", self.max_connections),
            ("--fd-max-connections", self.fd_max_connections),
            ("--fd-max-stashed", self.fd_max_stashed),
        ] {
            if let Some(v) = v {
                check_flag(flag, v, 1.., "use at least 1")?;
            }
        }
        let files = machine.open_files;
        let max_connections = self.max_connections.unwrap_or((files / 4).clamp(16, 4096));
        let fd_max_connections = self
            .fd_max_connections
            .unwrap_or((files / 16).clamp(4, 256));
        let fixed = max_connections + fd_max_connections + SPARE_FDS;
        let fd_max_stashed = match self.fd_max_stashed {
            Some(n) => n,
            None => files.saturating_sub(fixed).min(262_144),
        };
        if fd_max_stashed == 0 || fixed.saturating_add(fd_max_stashed) > files {
            return Err(ConfigError(format!(
                "the open-file limit of {files} cannot hold --max-connections {max_connections}, \
                 --fd-max-connections {fd_max_connections}, --fd-max-stashed {fd_max_stashed} and \
                 {SPARE_FDS} spare; lower them or raise the limit (ulimit -n, or LimitNOFILE= in \
                 the systemd unit)"
            )));
        }
        let numa = match self.numa.as_str() {
            "auto" => NumaMode::Auto,
            "off" => NumaMode::Off,
            "remote" => NumaMode::Remote,
            other => {
                return Err(ConfigError(format!(
                    "--numa {other}: unknown mode; use auto, off or remote"
                )))
            }
        };
        let fd_socket = match &self.fd_socket {
            Some(p) => p.clone(),
            None => machine
                .runtime_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("/tmp"))
                .join(if self.port == 0 {
                    // Port 0 is picked at bind time; the pid keeps two such servers apart.
                    format!("kvd-pid{}.fd.sock", std::process::id())
                } else {
                    format!("kvd-{}.fd.sock", self.port)
                }),
        };
        check_collisions(self, &fd_socket)?;
        Ok(Config {
            layout,
            size_rule,
            host: self.host.clone(),
            port: self.port,
            ipc: self.ipc.clone(),
            http_host: self.http_host.clone(),
            http_port: self.http_port,
            chunk_tokens: self.chunk_tokens,
            eviction,
            log_level: self.log_level.clone(),
            log_format,
            fd_socket,
            pin_timeout: Duration::from_millis(self.pin_timeout_ms),
            lookup_pin_frac: f64::from(self.lookup_pin_pct) / 100.0,
            lookup_hold_frac: f64::from(self.lookup_hold_pct) / 100.0,
            lookup_hold: Duration::from_millis(self.lookup_hold_ms),
            session_timeout: Duration::from_millis(self.session_timeout_ms),
            populate_threads: self.populate_threads.unwrap_or(machine.cpus.min(64)),
            copy_queue: self.copy_queue,
            max_frame_bytes,
            hugepages: !self.no_hugepages,
            max_connections,
            hello_timeout: Duration::from_millis(self.hello_timeout_ms),
            max_in_flight: self.max_in_flight,
            max_buffered_bytes: self.max_buffered_mb * MIB as usize,
            fd_socket_mode,
            fd_limits: FdLimits {
                max_connections: fd_max_connections,
                max_connections_per_uid: (fd_max_connections / 2).max(1),
                max_stashed: fd_max_stashed,
                max_stashed_per_uid: (fd_max_stashed / 2).max(1),
                own_uid: Some(machine.euid),
                idle_timeout: Duration::from_millis(self.fd_idle_timeout_ms),
            },
            topology: machine.topology.clone(),
            numa,
            l2: self.l2.resolve(machine.l2_password_env.as_ref())?,
            events_capacity: self.events.resolve()?,
            disk: self.disk.resolve()?,
        })
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
