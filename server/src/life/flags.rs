//! `kvd serve`'s flags and their defaults, as clap parses them; the tiers' and the removal
//! feed's are declared beside them and flattened in here. [`super::config`] checks them.

use std::path::{Path, PathBuf};

use clap::{Args, Parser, Subcommand};

use crate::config::ConfigError;
use crate::l1::events::FeedArgs;
use crate::tiers::disk::config::DiskArgs;
use crate::tiers::l2::config::L2Args;

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
    /// Folder for the presence filter, a shared-memory file (about 1 byte per 64 KiB of pool)
    /// through which connectors on this host skip the round trip of a lookup that would find
    /// nothing. Kept only when no disk or L2 tier is configured. `off`: none.
    #[arg(long, default_value = "/dev/shm", value_name = "DIR")]
    pub presence_dir: String,
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
    /// Copy jobs queued per device and direction before requests are refused as busy.
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
    /// MiB of prompts kept for warming a replacement engine (the connector's `kvd.warm_group`,
    /// `python -m kvd.warm`); 0 keeps none.
    #[arg(
        long,
        default_value_t = 256,
        value_name = "MIB",
        allow_negative_numbers = true
    )]
    pub recall_mb: usize,
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
    pub events: FeedArgs,
    /// The disk tier.
    #[command(flatten)]
    pub disk: DiskArgs,
}

impl ServeArgs {
    /// Two of kvd's own listeners on one port or one socket path: refused before binding, naming
    /// both flags (binding would fail on the second and blame "another process").
    pub(super) fn check_collisions(&self, fd_socket: &Path) -> Result<(), ConfigError> {
        let a = self;
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
