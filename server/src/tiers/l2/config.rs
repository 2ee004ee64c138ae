//! `kvd serve`'s L2 flags, their defaults, and the checks that turn bad values into one line
//! naming the flag and the fix.
//!
//! Secrets never pass through anything kvd prints. The password can come from a file
//! (`--l2-password-file`), the environment (`KVD_L2_PASSWORD`) or, as a last resort, the URL —
//! which every local user can read in the process list, so kvd warns. Whatever the source, the
//! URL kvd shows (`L2Config::url`, in logs and `/healthz`) is redacted; [`Secret`] and
//! [`MacKey`](crate::tiers::value::MacKey) print as `<redacted>` ([`super::secret`]). URLs are
//! taken apart in [`super::url`].

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::secret::{read_file, read_mac_key, trim_newlines, Secret, PASSWORD_ENV};
use super::url::{check_host_port, parse_url};
use crate::config::{check_flag, ConfigError};

/// Flags of the L2 tier.
#[derive(Debug, Clone, Default, Args)]
pub struct L2Args {
    /// L2 tier shared by every node: redis://[USER@]HOST:PORT[/DB] (one Valkey or Redis
    /// server), redis+cluster://[USER@]H1:P1,H2:P2,... (a cluster; any reachable nodes, the
    /// rest is discovered); rediss:// and rediss+cluster:// for TLS. Off when not given.
    #[arg(long, value_name = "URL")]
    pub l2: Option<String>,
    /// File holding the L2 password (or set KVD_L2_PASSWORD); trailing newlines are ignored.
    #[arg(long, value_name = "PATH")]
    pub l2_password_file: Option<PathBuf>,
    /// PEM file of the CA certificates that signed the L2 servers' certificates (rediss://);
    /// default: the system's trust store.
    #[arg(long, value_name = "PATH")]
    pub l2_ca_file: Option<PathBuf>,
    /// File holding a secret shared by every node's kvd (at least 16 bytes): values are
    /// written with a keyed MAC, and values without a valid one are rejected.
    #[arg(long, value_name = "PATH")]
    pub l2_secret_file: Option<PathBuf>,
    /// Expiry of chunks written to L2, in seconds; 0 leaves expiry to the server's maxmemory
    /// policy (allkeys-lru recommended).
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub l2_ttl_s: u64,
    /// How long a lookup waits for L2 before it answers with what L1 holds.
    #[arg(long, default_value_t = 250, value_name = "MS")]
    pub l2_deadline_ms: u64,
    /// Stored chunks waiting to be written to L2; beyond this they are dropped and counted.
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub l2_queue: usize,
    /// Connections to L2 (to each node, for a cluster), and write-behind batches in flight.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub l2_connections: usize,
    /// Most bytes one lookup fetches from L2.
    #[arg(long, default_value_t = 4096, value_name = "MIB")]
    pub l2_fetch_max_mb: u64,
}

/// Where the L2 is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum L2Target {
    /// One server: `HOST:PORT` and its database.
    Single {
        /// `HOST:PORT`.
        addr: String,
        /// The database number.
        db: i64,
    },
    /// A cluster: `HOST:PORT` of each seed node.
    Cluster(Vec<String>),
}

/// Validated L2 settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L2Config {
    /// The URL with any password replaced by `***`, for logs and /healthz.
    pub url: String,
    /// Where it is.
    pub target: L2Target,
    /// TLS (`rediss://`).
    pub tls: bool,
    /// The CA certificates of `--l2-ca-file`, PEM.
    pub ca_pem: Option<Vec<u8>>,
    /// The ACL user, if any.
    pub username: Option<String>,
    /// The password, if any.
    pub password: Option<Secret>,
    /// Whether the password came in the URL (visible in the process list: kvd warns).
    pub password_in_url: bool,
    /// The MAC key, with `--l2-secret-file`.
    pub mac_key: Option<crate::tiers::value::MacKey>,
    /// Expiry of written chunks (none: the server's policy decides).
    pub ttl: Option<Duration>,
    /// Lookup deadline.
    pub deadline: Duration,
    /// Write-behind queue capacity, in chunks.
    pub queue_chunks: usize,
    /// Connections and write batches in flight.
    pub connections: usize,
    /// Most bytes one lookup fetches.
    pub fetch_max_bytes: u64,
}

/// Bytes one write-behind batch gathers at most (at least one chunk).
pub const WRITE_BATCH_BYTES: u64 = 64 << 20;
/// How long a write-behind batch may take before it counts as failed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

impl L2Args {
    /// Checks the flags; `None` when no L2 is configured. `env_password` is
    /// `KVD_L2_PASSWORD`, if set.
    pub fn resolve(&self, env_password: Option<&Secret>) -> Result<Option<L2Config>, ConfigError> {
        let Some(raw) = &self.l2 else {
            for (flag, set) in [
                ("--l2-password-file", self.l2_password_file.is_some()),
                ("--l2-ca-file", self.l2_ca_file.is_some()),
                ("--l2-secret-file", self.l2_secret_file.is_some()),
            ] {
                if set {
                    return Err(ConfigError(format!(
                        "{flag} without --l2: give the L2's URL with --l2, or drop {flag}"
                    )));
                }
            }
            return Ok(None);
        };
        let p = parse_url(raw)?;
        let password_in_url = p.password.is_some();
        // The URL as shown: the user, never the password.
        let creds = match (
            &p.username,
            password_in_url || self.l2_password_file.is_some() || env_password.is_some(),
        ) {
            (Some(u), true) => format!("{u}:***@"),
            (None, true) => ":***@".to_string(),
            (Some(u), false) => format!("{u}@"),
            (None, false) => String::new(),
        };
        let url = format!("{}://{creds}{}", p.scheme, p.rest);
        let target = if p.cluster {
            let hosts = p.rest.trim_end_matches('/');
            if hosts.contains('/') {
                return Err(ConfigError(format!(
                    "--l2 {url}: a cluster has only database 0; drop the /DB"
                )));
            }
            let nodes = hosts
                .split(',')
                .map(|hp| check_host_port(&url, hp.trim()))
                .collect::<Result<Vec<_>, _>>()?;
            L2Target::Cluster(nodes)
        } else {
            let (hp, db) = p.rest.split_once('/').unwrap_or((&p.rest, ""));
            let addr = check_host_port(&url, hp)?;
            let db = match db {
                "" => 0,
                d => d.parse::<u32>().map_err(|_| {
                    ConfigError(format!(
                        "--l2 {url}: database {d:?} is not a number; use redis://HOST:PORT/0"
                    ))
                })?,
            };
            L2Target::Single {
                addr,
                db: i64::from(db),
            }
        };

        let from_file = match &self.l2_password_file {
            None => None,
            Some(path) => {
                let bytes = trim_newlines(read_file("--l2-password-file", path)?);
                let text = String::from_utf8(bytes).map_err(|_| {
                    ConfigError(format!(
                        "--l2-password-file {}: not UTF-8 text; Redis passwords are text",
                        path.display()
                    ))
                })?;
                if text.is_empty() {
                    return Err(ConfigError(format!(
                        "--l2-password-file {}: the file is empty; write the password into it",
                        path.display()
                    )));
                }
                Some(Secret::new(text))
            }
        };
        let sources = [
            ("a password in --l2", p.password.is_some()),
            ("--l2-password-file", from_file.is_some()),
            (PASSWORD_ENV, env_password.is_some()),
        ];
        let given: Vec<&str> = sources.iter().filter(|s| s.1).map(|s| s.0).collect();
        if given.len() > 1 {
            return Err(ConfigError(format!(
                "{}: give the L2 password one way only (--l2-password-file is best)",
                given.join(" and ")
            )));
        }
        let password = p.password.or(from_file).or_else(|| env_password.cloned());

        let ca_pem = match &self.l2_ca_file {
            None => None,
            Some(path) => {
                if !p.tls {
                    return Err(ConfigError(format!(
                        "--l2-ca-file {}: --l2 {url} is not TLS; use rediss:// (or \
                         rediss+cluster://), or drop --l2-ca-file",
                        path.display()
                    )));
                }
                let pem = read_file("--l2-ca-file", path)?;
                if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                    return Err(ConfigError(format!(
                        "--l2-ca-file {}: no PEM certificate in it; give the CA's certificate \
                         (-----BEGIN CERTIFICATE-----)",
                        path.display()
                    )));
                }
                Some(pem)
            }
        };
        let mac_key = self
            .l2_secret_file
            .as_deref()
            .map(read_mac_key)
            .transpose()?;

        check_flag(
            "--l2-deadline-ms",
            self.l2_deadline_ms,
            1..=60_000,
            "use 1 to 60000, e.g. 250",
        )?;
        check_flag(
            "--l2-queue",
            self.l2_queue,
            1..,
            "need room for at least one chunk, e.g. 4096",
        )?;
        check_flag(
            "--l2-connections",
            self.l2_connections,
            1..=64,
            "use 1 to 64, e.g. 4",
        )?;
        check_flag(
            "--l2-fetch-max-mb",
            self.l2_fetch_max_mb,
            1..,
            "a lookup could fetch nothing; use e.g. 4096",
        )?;
        Ok(Some(L2Config {
            url,
            target,
            tls: p.tls,
            ca_pem,
            username: p.username,
            password,
            password_in_url,
            mac_key,
            ttl: (self.l2_ttl_s > 0).then(|| Duration::from_secs(self.l2_ttl_s)),
            deadline: Duration::from_millis(self.l2_deadline_ms),
            queue_chunks: self.l2_queue,
            connections: self.l2_connections,
            fetch_max_bytes: self.l2_fetch_max_mb << 20,
        }))
    }
}

#[cfg(test)]
#[path = "config_tests.rs"]
mod tests;
