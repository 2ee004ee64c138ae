//! `kvd._native.Client`: one connection to kvd, shared by a scheduler or a worker. Requests that
//! may take a while (lookups, stores, retrieves) return a [`Pending`] at once, so neither vLLM's
//! scheduler loop nor its forward pass ever waits on kvd; `Pending.done()` never blocks.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvd_proto::client::{Client as RustClient, ClientConfig, ClientError};
use kvd_proto::wire::*;
use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::client_error;
use crate::register::{self, Registration};

/// The runtime all clients of this process share; made on first use, so a process that forks
/// before using kvd is unaffected.
pub(crate) fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvd-client")
            .enable_all()
            .build()
            .expect("starting kvd's client runtime")
    })
}

/// What a finished request returned.
enum Value {
    Lookup {
        hit: u32,
        pin_id: u64,
    },
    Copy {
        outcomes: Vec<u8>,
        done_slot: Option<u16>,
    },
    Released(u32),
}

struct Slot {
    value: Mutex<Option<Result<Value, ClientError>>>,
    ready: Condvar,
}

/// A request in flight.
#[pyclass(module = "kvd._native", frozen)]
pub(crate) struct Pending {
    slot: Arc<Slot>,
}

impl Pending {
    fn spawn<F>(fut: F) -> Pending
    where
        F: std::future::Future<Output = Result<Value, ClientError>> + Send + 'static,
    {
        let slot = Arc::new(Slot {
            value: Mutex::new(None),
            ready: Condvar::new(),
        });
        let s = slot.clone();
        runtime().spawn(async move {
            let r = fut.await;
            *s.value.lock() = Some(r);
            s.ready.notify_all();
        });
        Pending { slot }
    }
}

#[pymethods]
impl Pending {
    /// Whether the reply has arrived (never blocks).
    fn done(&self) -> bool {
        self.slot.value.lock().is_some()
    }

    /// The reply, waiting up to `timeout` seconds (forever with None). Lookups give
    /// `(hit_chunks, pin_id)`; stores and retrieves `(outcomes, done_slot)`; releases the number
    /// of chunk pins dropped.
    #[pyo3(signature = (timeout = None))]
    fn result(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let slot = self.slot.clone();
        let ready = py.detach(move || {
            let mut v = slot.value.lock();
            match timeout {
                None => {
                    while v.is_none() {
                        slot.ready.wait(&mut v);
                    }
                    true
                }
                Some(t) => {
                    let deadline = std::time::Instant::now() + Duration::from_secs_f64(t.max(0.0));
                    while v.is_none() {
                        if slot.ready.wait_until(&mut v, deadline).timed_out() {
                            break;
                        }
                    }
                    v.is_some()
                }
            }
        });
        if !ready {
            return Err(pyo3::exceptions::PyTimeoutError::new_err(
                "kvd has not answered yet",
            ));
        }
        let v = self.slot.value.lock();
        match v.as_ref().expect("checked above") {
            Ok(Value::Lookup { hit, pin_id }) => {
                Ok((*hit, *pin_id).into_pyobject(py)?.into_any().unbind())
            }
            Ok(Value::Copy {
                outcomes,
                done_slot,
            }) => Ok((outcomes.clone(), *done_slot)
                .into_pyobject(py)?
                .into_any()
                .unbind()),
            Ok(Value::Released(n)) => Ok(n.into_pyobject(py)?.into_any().unbind()),
            Err(e) => Err(client_error(e.clone())),
        }
    }
}

/// A connection to kvd.
#[pyclass(module = "kvd._native", frozen)]
pub(crate) struct Client {
    pub(crate) inner: RustClient,
}

fn chunk_blocks(chunks: Vec<(u128, Vec<u32>)>) -> Vec<ChunkBlocks> {
    chunks
        .into_iter()
        .map(|(hash, blocks)| ChunkBlocks { hash, blocks })
        .collect()
}

impl Client {
    /// Sends a store or retrieve; its Pending gives (outcome codes, kvd's event slot).
    fn copy(&self, req: Request) -> Pending {
        let c = self.inner.clone();
        Pending::spawn(async move {
            let (outcomes, done_slot) = match c.request(req).await? {
                Reply::Store(r) => (r.outcomes.iter().map(|o| *o as u8).collect(), r.done_slot),
                Reply::Retrieve(r) => (r.outcomes.iter().map(|o| *o as u8).collect(), r.done_slot),
                Reply::Error(e) => {
                    return Err(ClientError::Server {
                        code: e.code,
                        message: e.message,
                    })
                }
                other => return Err(ClientError::Protocol(format!("{other:?}"))),
            };
            Ok(Value::Copy {
                outcomes,
                done_slot,
            })
        })
    }
}

fn role(name: &str) -> PyResult<Role> {
    match name {
        "scheduler" => Ok(Role::Scheduler),
        "worker" => Ok(Role::Worker),
        "tool" => Ok(Role::Tool),
        other => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "role {other:?}: use scheduler, worker or tool"
        ))),
    }
}

#[pymethods]
impl Client {
    /// Connects to kvd at `url` (`tcp://host:port` or `ipc:///path`) and says hello.
    #[new]
    #[pyo3(signature = (url, name, role = "worker", connect_timeout = 5.0, request_timeout = 30.0, fd_socket = None, heartbeat = true))]
    fn new(
        py: Python<'_>,
        url: &str,
        name: &str,
        role: &str,
        connect_timeout: f64,
        request_timeout: f64,
        fd_socket: Option<String>,
        heartbeat: bool,
    ) -> PyResult<Self> {
        let mut cfg = ClientConfig::new(url, name, self::role(role)?);
        cfg.connect_timeout = Duration::from_secs_f64(connect_timeout.max(0.001));
        cfg.request_timeout = Duration::from_secs_f64(request_timeout.max(0.001));
        cfg.heartbeat = heartbeat;
        cfg.fd_socket = fd_socket.map(Into::into);
        let inner = py
            .detach(move || runtime().block_on(RustClient::connect(cfg)))
            .map_err(client_error)?;
        Ok(Client { inner })
    }

    /// What kvd said in its hello: chunk_tokens, fd_socket, session_timeout_ms, server_version,
    /// session_id, protocol_version.
    #[getter]
    fn server<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.inner.server();
        let d = PyDict::new(py);
        d.set_item("chunk_tokens", h.chunk_tokens)?;
        d.set_item("fd_socket", &h.fd_socket)?;
        d.set_item("session_timeout_ms", h.session_timeout_ms)?;
        d.set_item("server_version", &h.server_version)?;
        d.set_item("session_id", h.session_id)?;
        d.set_item("protocol_version", h.protocol_version)?;
        Ok(d)
    }

    /// False once the connection has broken; make a new Client to reconnect.
    fn connected(&self) -> bool {
        self.inner.is_connected()
    }

    /// Round trip; returns kvd's uptime in ms.
    fn ping(&self, py: Python<'_>) -> PyResult<u64> {
        let c = self.inner.clone();
        let r = py.detach(move || runtime().block_on(c.ping(Ping {})));
        Ok(r.map_err(client_error)?.uptime_ms)
    }

    /// kvd's counters.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.inner.clone();
        let s = py
            .detach(move || runtime().block_on(c.stats(StatsRequest {})))
            .map_err(client_error)?;
        let d = PyDict::new(py);
        d.set_item("pool_bytes_total", s.pool_bytes_total)?;
        d.set_item("pool_bytes_used", s.pool_bytes_used)?;
        d.set_item("chunks", s.chunks)?;
        d.set_item("pinned_pages", s.pinned_pages)?;
        d.set_item("sessions", s.sessions)?;
        d.set_item("regions", s.regions)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("store_refusals", s.store_refusals)?;
        Ok(d)
    }

    /// Longest stored prefix of `hashes` on every shard in `shards`; with `pin`, pinned until
    /// retrieved by `readers` ranks per shard, released, or timed out.
    #[pyo3(signature = (fingerprint, salt, shards, hashes, pin = true, readers = 1))]
    fn lookup(
        &self,
        fingerprint: u64,
        salt: u64,
        shards: Vec<u32>,
        hashes: Vec<u128>,
        pin: bool,
        readers: u16,
    ) -> Pending {
        let c = self.inner.clone();
        Pending::spawn(async move {
            let r = c
                .lookup(Lookup {
                    fingerprint,
                    salt,
                    shards,
                    hashes,
                    pin,
                    readers,
                })
                .await?;
            Ok(Value::Lookup {
                hit: r.hit_chunks,
                pin_id: r.pin_id,
            })
        })
    }

    /// Drops a lookup pin.
    fn release(&self, pin_id: u64) -> Pending {
        let c = self.inner.clone();
        Pending::spawn(
            async move { Ok(Value::Released(c.release(Release { pin_id }).await?.chunks)) },
        )
    }

    /// Copies chunks `(hash, block_ids)` from the registered cache into kvd, after the client
    /// event `wait_slot` (if any). Outcomes: 0 stored, 1 already stored, 2 refused (pool full),
    /// 3 skipped.
    #[pyo3(signature = (region, salt, chunks, wait_slot = None))]
    fn store(
        &self,
        region: u32,
        salt: u64,
        chunks: Vec<(u128, Vec<u32>)>,
        wait_slot: Option<u16>,
    ) -> Pending {
        let chunks = chunk_blocks(chunks);
        self.copy(Request::Store(Store {
            region,
            salt,
            chunks,
            wait_slot,
        }))
    }

    /// Copies chunks from kvd into `(hash, block_ids)` of the registered cache (a block id of
    /// 0xFFFFFFFF is left untouched). Outcomes: 0 loaded, 1 missing.
    #[pyo3(signature = (region, salt, chunks, pin_id = 0, wait_slot = None))]
    fn retrieve(
        &self,
        region: u32,
        salt: u64,
        chunks: Vec<(u128, Vec<u32>)>,
        pin_id: u64,
        wait_slot: Option<u16>,
    ) -> Pending {
        let chunks = chunk_blocks(chunks);
        self.copy(Request::Retrieve(Retrieve {
            region,
            salt,
            pin_id,
            chunks,
            wait_slot,
        }))
    }

    /// Registers a KV cache whose layers start at `layer_ptrs` (block 0) and share `layout` (a
    /// dict of the KvLayout fields, strides in bytes). `device` is "cuda" or "host". CUDA
    /// memory is shared by legacy IPC handle, or by descriptor when it is VMM memory.
    #[pyo3(signature = (fingerprint, shard, device, layer_ptrs, layout, events = 64))]
    fn register(
        &self,
        py: Python<'_>,
        fingerprint: u64,
        shard: u32,
        device: &str,
        layer_ptrs: Vec<u64>,
        layout: &Bound<'_, PyDict>,
        events: usize,
    ) -> PyResult<Registration> {
        let layout = register::layout_from_dict(layout)?;
        register::register(
            py,
            &self.inner,
            fingerprint,
            shard,
            device,
            layer_ptrs,
            layout,
            events,
        )
    }

    /// Drops a registration (kvd unmaps the memory).
    fn unregister(&self, py: Python<'_>, region: u32) -> PyResult<()> {
        let c = self.inner.clone();
        py.detach(move || runtime().block_on(c.unregister(region)))
            .map_err(client_error)
    }
}
