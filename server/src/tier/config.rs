//! `kvd serve`'s L2 flags, their defaults, and the checks that turn bad values into one line
//! naming the flag and the fix.

use std::time::Duration;

use clap::Args;

use crate::config::ConfigError;

/// Flags of the L2 tier.
#[derive(Debug, Clone, Default, Args)]
pub struct L2Args {
    /// L2 tier shared by every node: redis://HOST:PORT (one Valkey or Redis server) or
    /// redis+cluster://H1:P1,H2:P2,... (a cluster; any reachable nodes, the rest is
    /// discovered). Off when not given.
    #[arg(long, value_name = "URL")]
    pub l2: Option<String>,
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
    /// One server: `redis://HOST:PORT[/DB]`.
    Single(String),
    /// A cluster: one `redis://HOST:PORT` per seed node.
    Cluster(Vec<String>),
}

/// Validated L2 settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct L2Config {
    /// The URL as given, for logs and /healthz.
    pub url: String,
    /// Where it is.
    pub target: L2Target,
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

fn host_port(flag_value: &str, hp: &str) -> Result<String, ConfigError> {
    let bad = || {
        ConfigError(format!(
            "--l2 {flag_value}: {hp:?} is not HOST:PORT; use redis://HOST:PORT or \
             redis+cluster://H1:P1,H2:P2"
        ))
    };
    let (host, port) = hp.rsplit_once(':').ok_or_else(bad)?;
    if host.is_empty() || port.parse::<u16>().map_or(true, |p| p == 0) {
        return Err(bad());
    }
    Ok(format!("redis://{hp}"))
}

impl L2Args {
    /// Checks the flags; `None` when no L2 is configured.
    pub fn resolve(&self) -> Result<Option<L2Config>, ConfigError> {
        let Some(url) = &self.l2 else {
            return Ok(None);
        };
        let target = if let Some(rest) = url.strip_prefix("redis+cluster://") {
            let nodes = rest
                .trim_end_matches('/')
                .split(',')
                .map(|hp| host_port(url, hp.trim()))
                .collect::<Result<Vec<_>, _>>()?;
            L2Target::Cluster(nodes)
        } else if let Some(rest) = url.strip_prefix("redis://") {
            let (hp, db) = rest.split_once('/').unwrap_or((rest, ""));
            host_port(url, hp)?;
            if !db.is_empty() && db.parse::<u32>().is_err() {
                return Err(ConfigError(format!(
                    "--l2 {url}: database {db:?} is not a number; use redis://HOST:PORT/0"
                )));
            }
            L2Target::Single(url.clone())
        } else {
            return Err(ConfigError(format!(
                "--l2 {url}: unknown scheme; use redis://HOST:PORT (Valkey or Redis) or \
                 redis+cluster://H1:P1,H2:P2 (a cluster)"
            )));
        };
        if self.l2_deadline_ms == 0 || self.l2_deadline_ms > 60_000 {
            return Err(ConfigError(format!(
                "--l2-deadline-ms {}: use 1 to 60000, e.g. 250",
                self.l2_deadline_ms
            )));
        }
        if self.l2_queue == 0 {
            return Err(ConfigError(
                "--l2-queue 0: need room for at least one chunk, e.g. 4096".into(),
            ));
        }
        if self.l2_connections == 0 || self.l2_connections > 64 {
            return Err(ConfigError(format!(
                "--l2-connections {}: use 1 to 64, e.g. 4",
                self.l2_connections
            )));
        }
        if self.l2_fetch_max_mb == 0 {
            return Err(ConfigError(
                "--l2-fetch-max-mb 0: a lookup could fetch nothing; use e.g. 4096".into(),
            ));
        }
        Ok(Some(L2Config {
            url: url.clone(),
            target,
            ttl: (self.l2_ttl_s > 0).then(|| Duration::from_secs(self.l2_ttl_s)),
            deadline: Duration::from_millis(self.l2_deadline_ms),
            queue_chunks: self.l2_queue,
            connections: self.l2_connections,
            fetch_max_bytes: self.l2_fetch_max_mb << 20,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(url: &str) -> L2Args {
        L2Args {
            l2: Some(url.into()),
            l2_deadline_ms: 250,
            l2_queue: 4096,
            l2_connections: 4,
            l2_fetch_max_mb: 4096,
            ..L2Args::default()
        }
    }

    #[test]
    fn urls_name_one_server_or_a_cluster() {
        assert_eq!(L2Args::default().resolve().unwrap(), None);
        let c = args("redis://127.0.0.1:6379").resolve().unwrap().unwrap();
        assert_eq!(c.target, L2Target::Single("redis://127.0.0.1:6379".into()));
        assert_eq!(c.ttl, None);
        let c = args("redis+cluster://10.0.0.1:7000, 10.0.0.2:7001")
            .resolve()
            .unwrap()
            .unwrap();
        assert_eq!(
            c.target,
            L2Target::Cluster(vec![
                "redis://10.0.0.1:7000".into(),
                "redis://10.0.0.2:7001".into()
            ])
        );
    }

    #[test]
    fn bad_values_name_the_flag_and_the_fix() {
        for (a, want) in [
            (args("valkey://h:1"), "unknown scheme; use redis://"),
            (args("redis://nohost"), "is not HOST:PORT"),
            (args("redis+cluster://a:1,b:x"), "\"b:x\" is not HOST:PORT"),
            (args("redis://h:1/x"), "use redis://HOST:PORT/0"),
            (
                L2Args {
                    l2_queue: 0,
                    ..args("redis://h:1")
                },
                "--l2-queue 0",
            ),
            (
                L2Args {
                    l2_deadline_ms: 0,
                    ..args("redis://h:1")
                },
                "--l2-deadline-ms 0",
            ),
        ] {
            let err = a.resolve().unwrap_err().0;
            assert!(err.contains(want), "{err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }
}
