//! The Valkey/Redis adapter: one server (`redis://`) or a cluster (`redis+cluster://`), through
//! the `redis` crate's multiplexed tokio connections — a connection manager per connection for
//! one server, the crate's cluster connection (slot map, MOVED/ASK, node reconnects) for a
//! cluster. Both reconnect by themselves; kvd never waits for that on a request path.
//!
//! A batch is one command per chunk, all issued at once and spread over `--l2-connections`
//! connections: a multiplexed connection writes queued commands back to back, so a batch costs
//! one round trip per node, not one per chunk. (A cluster refuses multi-key commands and
//! pipelines across hash slots, and chunk keys are spread over every slot on purpose, so that
//! every node holds its share.)
//!
//! Credentials and TLS come from [`L2Config`], never from a URL kvd prints: the user and
//! password are set on the connection settings (or the cluster builder), and `rediss://`
//! connections verify the servers' certificates against `--l2-ca-file` (else the system's
//! trust store) through rustls.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::future::join_all;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::{IntoConnectionInfo, RedisError, TlsCertificates};

use super::config::{L2Config, L2Target, WRITE_TIMEOUT};
use super::{BoxFuture, L2Error, L2Store};
use crate::l1::cache::Key;

/// How long connecting to one server may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// L2 on Valkey or Redis.
pub struct RedisStore {
    conns: Vec<Conn>,
    next: AtomicUsize,
    ttl_s: Option<u64>,
    url: String,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("url", &self.url)
            .field("connections", &self.conns.len())
            .finish()
    }
}

fn classify(op: &'static str, e: RedisError) -> L2Error {
    let message = e.to_string();
    if message.contains("OOM") {
        L2Error::Full { op, message }
    } else if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || message.contains("CLUSTERDOWN")
    {
        L2Error::Unavailable { op, message }
    } else {
        L2Error::Failed { op, message }
    }
}

impl RedisStore {
    /// Creates the connections without waiting for any server: they connect on first use and
    /// reconnect after failures, so kvd starts and serves from L1 while L2 is unreachable.
    pub fn connect(config: &L2Config) -> Result<RedisStore, L2Error> {
        let setup = |e: RedisError| L2Error::Failed {
            op: "connect",
            message: format!("{e}; check --l2 {} and --l2-ca-file", config.url),
        };
        let scheme = if config.tls { "rediss" } else { "redis" };
        let certs = TlsCertificates {
            client_tls: None,
            root_cert: config.ca_pem.clone(),
        };
        let conns = match &config.target {
            L2Target::Single { addr, db } => {
                let info = format!("{scheme}://{addr}/{db}")
                    .into_connection_info()
                    .map_err(setup)?;
                let mut settings = info.redis_settings().clone();
                if let Some(u) = &config.username {
                    settings = settings.set_username(u);
                }
                if let Some(p) = &config.password {
                    settings = settings.set_password(p.expose());
                }
                let info = info.set_redis_settings(settings);
                let client = if config.tls {
                    redis::Client::build_with_tls(info, certs).map_err(setup)?
                } else {
                    redis::Client::open(info).map_err(setup)?
                };
                let manager = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(WRITE_TIMEOUT))
                    .set_max_delay(Duration::from_secs(2))
                    .set_number_of_retries(2);
                (0..config.connections)
                    .map(|_| {
                        ConnectionManager::new_lazy_with_config(client.clone(), manager.clone())
                            .map(Conn::Single)
                            .map_err(setup)
                    })
                    .collect::<Result<Vec<_>, _>>()?
            }
            L2Target::Cluster(nodes) => {
                let mut builder =
                    ClusterClient::builder(nodes.iter().map(|hp| format!("{scheme}://{hp}")))
                        .connection_timeout(CONNECT_TIMEOUT)
                        .response_timeout(WRITE_TIMEOUT)
                        .retries(2);
                if let Some(u) = &config.username {
                    builder = builder.username(u);
                }
                if let Some(p) = &config.password {
                    builder = builder.password(p.expose());
                }
                if config.tls {
                    builder = builder.certs(certs);
                }
                let client = builder.build().map_err(setup)?;
                let cluster = redis::cluster::ClusterConfig::new()
                    .set_connection_timeout(CONNECT_TIMEOUT)
                    .set_response_timeout(WRITE_TIMEOUT);
                (0..config.connections)
                    .map(|_| {
                        Conn::Cluster(
                            client.get_pending_async_connection_with_config(cluster.clone()),
                        )
                    })
                    .collect()
            }
        };
        Ok(RedisStore {
            conns,
            next: AtomicUsize::new(0),
            ttl_s: config.ttl.map(|t| t.as_secs()),
            url: config.url.clone(),
        })
    }

    /// The connection for the `i`th command of a batch that starts at `start`.
    fn conn(&self, start: usize, i: usize) -> Conn {
        self.conns[(start + i) % self.conns.len()].clone()
    }
}

/// The L2 key of a chunk: namespaced by format, model fingerprint, salt and shard, so models,
/// tenants and TP ranks never share a value.
pub fn key_name(key: &Key) -> String {
    format!(
        "kvd:1:{:016x}:{:016x}:{}:{:032x}",
        key.fingerprint, key.salt, key.shard, key.hash
    )
}

async fn run<T: redis::FromRedisValue>(conn: Conn, cmd: redis::Cmd) -> Result<T, RedisError> {
    match conn {
        Conn::Single(mut c) => query(&mut c, cmd).await,
        Conn::Cluster(mut c) => query(&mut c, cmd).await,
    }
}

async fn query<T: redis::FromRedisValue, C: ConnectionLike>(
    c: &mut C,
    cmd: redis::Cmd,
) -> Result<T, RedisError> {
    cmd.query_async(c).await
}

impl L2Store for RedisStore {
    fn describe(&self) -> String {
        self.url.clone()
    }

    fn name_of(&self, key: &Key) -> String {
        key_name(key)
    }

    fn get_many<'a>(
        &'a self,
        keys: &'a [Key],
    ) -> BoxFuture<'a, Vec<Result<Option<Vec<u8>>, L2Error>>> {
        Box::pin(async move {
            let start = self.next.fetch_add(keys.len(), Ordering::Relaxed);
            let gets = keys.iter().enumerate().map(|(i, k)| {
                let mut cmd = redis::cmd("GET");
                cmd.arg(key_name(k));
                run::<Option<Vec<u8>>>(self.conn(start, i), cmd)
            });
            join_all(gets)
                .await
                .into_iter()
                .map(|r| r.map_err(|e| classify("get", e)))
                .collect()
        })
    }

    fn put_many(&self, items: Vec<(Key, Vec<u8>)>) -> BoxFuture<'_, Vec<Result<(), L2Error>>> {
        Box::pin(async move {
            let start = self.next.fetch_add(items.len(), Ordering::Relaxed);
            let sets = items.into_iter().enumerate().map(|(i, (k, v))| {
                let mut cmd = redis::cmd("SET");
                cmd.arg(key_name(&k)).arg(v);
                if let Some(ttl) = self.ttl_s {
                    cmd.arg("EX").arg(ttl);
                }
                run::<()>(self.conn(start, i), cmd)
            });
            join_all(sets)
                .await
                .into_iter()
                .map(|r| r.map_err(|e| classify("set", e)))
                .collect()
        })
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), L2Error>> {
        // Every connection, so that each one notices a restarted server and reconnects in the
        // background rather than on a lookup's path.
        Box::pin(async move {
            let pings = self
                .conns
                .iter()
                .map(|c| run::<String>(c.clone(), redis::cmd("PING")));
            join_all(pings)
                .await
                .into_iter()
                .find_map(Result::err)
                .map_or(Ok(()), |e| Err(classify("ping", e)))
        })
    }
}
