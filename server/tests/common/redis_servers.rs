//! Real Valkey/Redis servers for the L2 tests: one server, or a cluster of masters made with
//! `redis-cli --cluster create`, on free loopback ports in a temp dir, killed on drop. Without
//! `redis-server` (or `valkey-server`) the tests fail and say what to install: CI installs it.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::TempDir;

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

/// `valkey-server` or `redis-server`, whichever is installed.
pub fn server_bin() -> &'static str {
    first_on_path(&["valkey-server", "redis-server"]).unwrap_or_else(|| {
        panic!(
            "the L2 tests need a real Valkey or Redis server: install one \
             (Debian/Ubuntu: apt-get install -y redis-server redis-tools) — \
             scripts/test.sh does this itself"
        )
    })
}

/// `valkey-cli` or `redis-cli`.
pub fn cli_bin() -> &'static str {
    first_on_path(&["valkey-cli", "redis-cli"]).unwrap_or_else(|| {
        panic!("the L2 cluster tests need redis-cli: apt-get install -y redis-tools")
    })
}

/// A loopback port that is free, and whose cluster bus port (+10000) is free too.
///
/// Both are taken below Linux's ephemeral range (32768-60999 by default), from a walk this
/// process alone makes: a port the kernel handed out (bind to port 0) can be handed out again, to
/// any outgoing connection, before the server binds it — CI lost a test to exactly that ("bind:
/// Address already in use"). Below the range only a server that asks for the port by number can
/// take it, and the walk never names the same port twice in one test binary.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 12_000;
    const SPAN: u32 = 10_000; // ports 12000-21999, bus ports 22000-31999
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    // Each test binary starts the walk at its own place, so that two binaries run side by side
    // (two cargo invocations) rarely meet.
    let _ = NEXT.compare_exchange(
        u32::MAX,
        std::process::id().wrapping_mul(7_919) % SPAN,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    for _ in 0..SPAN {
        let port = (FIRST + NEXT.fetch_add(1, Ordering::Relaxed) % SPAN) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
        {
            return port;
        }
    }
    panic!("no free loopback port pair in {FIRST}-{}", FIRST + SPAN - 1)
}

/// One running server.
pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a server with `extra` settings (`--name value` pairs) and waits for PING.
    pub fn start(extra: &[&str]) -> RedisServer {
        Self::start_on(free_port(), extra)
    }

    /// Starts a server on `port`.
    pub fn start_on(port: u16, extra: &[&str]) -> RedisServer {
        let mut s = RedisServer {
            port,
            child: None,
            dir: TempDir::new("redis"),
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        s.spawn();
        s
    }

    fn spawn(&mut self) {
        let child = Command::new(server_bin())
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .args(["--dir", &self.dir.0.display().to_string()])
            .args(["--logfile", "server.log"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        // A server that could not start (its port taken) exits; another process's server on the
        // port could still answer PING, so the child must be alive once PING answers.
        while self.try_cmd(&["PING"]).is_err() || self.exited() {
            assert!(
                !self.exited(),
                "redis-server on port {} exited; its log:\n{}",
                self.port,
                std::fs::read_to_string(self.dir.0.join("server.log")).unwrap_or_default()
            );
            assert!(
                Instant::now() < deadline,
                "redis-server on port {} did not answer; its log:\n{}",
                self.port,
                std::fs::read_to_string(self.dir.0.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn exited(&mut self) -> bool {
        let child = self.child.as_mut().expect("spawned");
        !matches!(child.try_wait(), Ok(None))
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The password of `--requirepass`, if the server was started with one.
    fn password(&self) -> Option<&str> {
        let i = self.extra.iter().position(|a| a == "--requirepass")?;
        self.extra.get(i + 1).map(String::as_str)
    }

    pub fn dir(&self) -> &Path {
        &self.dir.0
    }

    /// A connection to this server alone.
    pub fn conn(&self) -> redis::RedisResult<redis::Connection> {
        let url = match self.password() {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}", self.port),
            None => self.url(),
        };
        let client = redis::Client::open(url)?;
        client.get_connection_with_timeout(Duration::from_secs(2))
    }

    /// Runs a command on this server alone.
    pub fn try_cmd(&self, args: &[&str]) -> redis::RedisResult<redis::Value> {
        let mut c = self.conn()?;
        let mut cmd = redis::cmd(args[0]);
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query(&mut c)
    }

    pub fn cmd(&self, args: &[&str]) -> redis::Value {
        self.try_cmd(args)
            .unwrap_or_else(|e| panic!("{args:?} on port {}: {e}", self.port))
    }

    /// The keys kvd wrote here.
    pub fn kvd_keys(&self) -> Vec<String> {
        let mut c = self.conn().unwrap();
        redis::cmd("KEYS").arg("kvd:*").query(&mut c).unwrap()
    }

    pub fn get(&self, key: &str) -> Option<Vec<u8>> {
        let mut c = self.conn().unwrap();
        redis::cmd("GET").arg(key).query(&mut c).unwrap()
    }

    pub fn set(&self, key: &str, value: &[u8]) {
        let mut c = self.conn().unwrap();
        redis::cmd("SET")
            .arg(key)
            .arg(value)
            .query::<()>(&mut c)
            .unwrap();
    }

    /// Sends a signal to the server (STOP makes it slow: it answers nothing until CONT).
    /// STOP returns once the server has stopped.
    pub fn signal(&self, sig: rustix::process::Signal) {
        let child = self.child.as_ref().expect("running");
        if sig == rustix::process::Signal::STOP {
            super::stop_process(child.id());
        } else {
            rustix::process::kill_process(rustix::process::Pid::from_child(child), sig).unwrap();
        }
    }

    /// Kills the server (SIGKILL: no goodbye to clients or peers).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server again on its port and directory (a cluster node rejoins from its
    /// nodes.conf).
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        if let Some(c) = &self.child {
            // A stopped server must be continued to die promptly on SIGKILL's heels.
            let _ = rustix::process::kill_process(
                rustix::process::Pid::from_child(c),
                rustix::process::Signal::CONT,
            );
        }
        self.kill();
    }
}

/// A cluster of masters, no replicas. `cluster-require-full-coverage no`, as docs/tiers.md
/// recommends for kvd: the surviving nodes keep serving their slots when one is lost.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

impl RedisCluster {
    pub fn start(masters: usize) -> RedisCluster {
        Self::start_with(&vec![vec![]; masters])
    }

    /// A cluster of one master per entry of `extra`, each started with those settings too.
    pub fn start_with(extra: &[Vec<String>]) -> RedisCluster {
        let nodes: Vec<RedisServer> = extra
            .iter()
            .map(|more| {
                let mut args = vec![
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "1000",
                    "--cluster-require-full-coverage",
                    "no",
                ];
                args.extend(more.iter().map(String::as_str));
                RedisServer::start(&args)
            })
            .collect();
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        let out = Command::new(cli_bin())
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster { nodes };
        cluster.wait_ok(Duration::from_secs(30));
        cluster
    }

    /// Waits until every running node reports `cluster_state:ok`.
    pub fn wait_ok(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let ok = self.nodes.iter().filter(|n| n.child.is_some()).all(|n| {
                match n.try_cmd(&["CLUSTER", "INFO"]) {
                    Ok(redis::Value::BulkString(b)) => {
                        String::from_utf8_lossy(&b).contains("cluster_state:ok")
                    }
                    Ok(redis::Value::VerbatimString { text, .. }) => {
                        text.contains("cluster_state:ok")
                    }
                    _ => false,
                }
            });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster did not become ok");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `redis+cluster://H1:P1,H2:P2,...`.
    pub fn url(&self) -> String {
        let nodes: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }
}
