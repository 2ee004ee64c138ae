//! A kvd started in this process on port 0: the default harness for tests that need no process
//! of their own (no signal, exit status, log or resource limit of kvd's). It is the server the
//! binary runs — `kvd serve`'s flags resolved against this machine, bound with `bind` (which
//! says where it listens, so no log is read) and served with `serve` on a runtime of its own —
//! and it drains and releases everything when dropped.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use clap::Parser;
use kvd_server::data::devices::discover_gpu;
use kvd_server::life::flags::{Cli, Command};
use kvd_server::life::machine::Machine;
use kvd_server::life::server::bind;
use tokio::sync::oneshot;

use super::{raise_open_files, Running, TempDir};

/// A kvd serving in this process.
pub struct InProcess {
    /// ZMQ endpoint.
    pub zmq: String,
    /// HTTP address.
    pub http: SocketAddr,
    /// Its fd socket.
    pub fd_socket: PathBuf,
    /// Its temp dir.
    pub dir: TempDir,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), String>>>,
}

impl InProcess {
    /// Starts kvd with a small pool and `extra` flags (as [`super::Kvd::start`] does), and
    /// returns once it has bound its sockets.
    pub fn start(extra: &[&str]) -> InProcess {
        raise_open_files();
        let dir = TempDir::new("inproc");
        let fd_socket = dir.0.join("fd.sock");
        let fd = fd_socket.display().to_string();
        let mut argv = vec![
            "kvd",
            "serve",
            "--port",
            "0",
            "--http-port",
            "0",
            "--fd-socket",
            &fd,
        ];
        if !extra.contains(&"--l1-size-gb") {
            argv.extend(["--l1-size-gb", "0.25"]);
        }
        argv.extend_from_slice(extra);
        let Command::Serve(args) = Cli::try_parse_from(&argv)
            .unwrap_or_else(|e| panic!("kvd {argv:?}: {e}"))
            .command;
        // As the tests' child kvd runs: without the environment's pool size or L2 password.
        let machine = Machine {
            total_cpu_dram_gb: None,
            l2_password_env: None,
            ..Machine::probe()
        };
        let config = args
            .resolve(&machine)
            .unwrap_or_else(|e| panic!("kvd {argv:?}: {e}"));
        let (bound_tx, bound_rx) = mpsc::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("kvd-in-process".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("kvd-rt")
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                runtime.block_on(async move {
                    let listening = match bind(config).await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = bound_tx.send(Err(e.to_string()));
                            return Err(e.to_string());
                        }
                    };
                    let _ = bound_tx.send(Ok(listening.bound().clone()));
                    listening
                        .serve(discover_gpu(), async {
                            let _ = stopped.await;
                        })
                        .await
                        .map_err(|e| e.to_string())
                })
            })
            .expect("a thread for kvd");
        let bound = match bound_rx.recv_timeout(Duration::from_secs(20)) {
            Ok(Ok(b)) => b,
            Ok(Err(e)) => panic!("kvd did not start: {e}"),
            Err(e) => panic!("kvd did not bind: {e}"),
        };
        InProcess {
            zmq: bound.zmq[0].to_string(),
            http: bound.http,
            fd_socket,
            dir,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    /// Starts kvd and waits until /healthz answers 200 and the whole pool is ready.
    pub fn ready(extra: &[&str]) -> InProcess {
        let k = InProcess::start(extra);
        k.wait_healthy(Duration::from_secs(30));
        k.wait_pool_full(Duration::from_secs(30));
        k
    }

    /// Stops it as SIGTERM stops the binary, and waits until it has drained and released
    /// everything; returns what serving returned.
    pub fn stop(mut self) -> Result<(), String> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), String> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(t) => t.join().map_err(|_| "kvd's thread panicked".to_string())?,
            None => Ok(()),
        }
    }
}

impl Running for InProcess {
    fn zmq_endpoint(&self) -> &str {
        &self.zmq
    }

    fn http_addr(&self) -> SocketAddr {
        self.http
    }

    fn log(&self) -> String {
        "(kvd runs in this process; its log is not captured)".into()
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        if let Err(e) = self.stop_and_join() {
            eprintln!("in-process kvd: {e}");
        }
    }
}
