//! The settings `kvd serve` runs with: every flag ([`super::flags`]) checked against the
//! machine ([`super::machine`]) and its defaults resolved, each bad value refused in one line
//! naming the flag and the fix. The tiers' flags and the removal feed's are resolved beside
//! them; the pool's size in [`super::pool_size`].

use std::path::PathBuf;
use std::time::Duration;

use kvd_gpu::PoolLayout;

use super::flags::ServeArgs;
use super::machine::Machine;
use super::pool_size::pool_layout;
pub use super::pool_size::SizeRule;
use crate::config::{check_flag, ConfigError};
use crate::control::fdpass::FdLimits;
use crate::l1::evict::PolicyKind;
use crate::l1::numa::{NumaMode, Topology};
use crate::tiers::disk::config::DiskConfig;
use crate::tiers::l2::config::L2Config;

const MIB: u64 = 1 << 20;

/// Descriptors kept free for listeners, HTTP connections, the pool, logs and the GPU driver.
pub const SPARE_FDS: usize = 128;
/// Most first-touch threads.
pub const MAX_POPULATE_THREADS: usize = 1024;

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
    /// Folder of the presence filter; None: no filter.
    pub presence_dir: Option<PathBuf>,
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
    /// Copy queue depth per device and direction.
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
    /// Bytes of prompts remembered for warming engines (0: none).
    pub recall_bytes: usize,
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

/// A log filter is a comma-separated list of directives; a bare word must be a level (a
/// target alone, such as `verbose`, would silently switch off everything else).
fn log_filter_is_valid(filter: &str) -> bool {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    tracing_subscriber::EnvFilter::try_new(filter).is_ok()
        && filter.split(',').map(str::trim).all(|d| {
            d.contains('=') || d.contains('[') || LEVELS.contains(&d.to_ascii_lowercase().as_str())
        })
}

impl ServeArgs {
    /// Checks every flag against the machine and resolves the defaults.
    pub fn resolve(&self, machine: &Machine) -> Result<Config, ConfigError> {
        let (layout, size_rule) = pool_layout(self, machine)?;

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
        check_flag(
            "--recall-mb",
            self.recall_mb,
            0..=1 << 20,
            "use 0 (remember no prompts) to 1048576, e.g. 256",
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
        self.check_collisions(&fd_socket)?;
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
            presence_dir: (self.presence_dir != "off" && !self.presence_dir.is_empty())
                // Absolute: clients open the path kvd names from their own working directory.
                .then(|| {
                    std::path::absolute(&self.presence_dir)
                        .unwrap_or_else(|_| PathBuf::from(&self.presence_dir))
                }),
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
            recall_bytes: self.recall_mb * MIB as usize,
            disk: self.disk.resolve()?,
        })
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
