//! `kvd._native.Client`: one connection to kvd, shared by a scheduler or a worker. Requests that
//! may take a while (lookups, stores, retrieves) return a [`Pending`] at once, so neither vLLM's
//! scheduler loop nor its forward pass ever waits on kvd; `Pending.done()` never blocks.
//!
//! The calling thread writes the request itself (with the GIL released) and the client's
//! reading task fills the Pending's slot: a request reaches kvd without waking another thread,
//! and its reply wakes only the thread that waits for it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvd_proto::client::{Client as RustClient, ClientConfig, ClientError, OnReply};
use kvd_proto::wire::*;
use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::client_error;
use crate::presence::Filter;
use crate::register::{self, Registration};
use crate::runtime::runtime;

/// What a finished request returned.
#[derive(Debug, PartialEq, Eq)]
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
    Events {
        /// `(fingerprint, salt, shard, hash)` of each removed chunk.
        records: Vec<(u64, u64, u32, u128)>,
        next: u64,
        dropped: u64,
    },
    /// Prompts the group holds after a remember.
    Remembered(u32),
    Recalled {
        /// `(salt, tokens, age_ms)` of the prompt asked for, if the group holds one there.
        prompt: Option<(String, Vec<u32>, u64)>,
        prompts: u32,
    },
}

fn server_error(e: ErrorReply) -> ClientError {
    ClientError::Server {
        code: e.code,
        message: e.message,
    }
}

/// Turns a reply into the value its request's Pending gives.
fn value_of(reply: Reply) -> Result<Value, ClientError> {
    match reply {
        Reply::Lookup(r) => Ok(Value::Lookup {
            hit: r.hit_chunks,
            pin_id: r.pin_id,
        }),
        Reply::Store(r) => Ok(Value::Copy {
            outcomes: r.outcomes.iter().map(|o| *o as u8).collect(),
            done_slot: r.done_slot,
        }),
        Reply::Retrieve(r) => Ok(Value::Copy {
            outcomes: r.outcomes.iter().map(|o| *o as u8).collect(),
            done_slot: r.done_slot,
        }),
        Reply::Released(r) => Ok(Value::Released(r.chunks)),
        Reply::Events(r) => Ok(Value::Events {
            records: r
                .records
                .iter()
                .map(|c| (c.fingerprint, c.salt, c.shard, c.hash))
                .collect(),
            next: r.next,
            dropped: r.dropped,
        }),
        Reply::Remembered(r) => Ok(Value::Remembered(r.prompts)),
        Reply::Recalled(r) => Ok(Value::Recalled {
            prompt: r.prompt.map(|p| (p.salt, p.tokens, p.age_ms)),
            prompts: r.prompts,
        }),
        Reply::Error(e) => Err(server_error(e)),
        other => Err(ClientError::Protocol(format!("{other:?}"))),
    }
}

struct Slot {
    value: Mutex<Option<Result<Value, ClientError>>>,
    ready: Condvar,
}

/// A request in flight.
#[pyclass(module = "kvd._native", frozen)]
pub(crate) struct Pending {
    slot: Arc<Slot>,
    client: RustClient,
    id: u64,
    op: &'static str,
    /// When the request times out (the client's request_timeout after sending).
    deadline: Instant,
}

impl Pending {
    /// A Pending for request `id` of `req`'s kind, and the reply handler that fills it (and then
    /// drops `held`, if any).
    fn new(
        client: &RustClient,
        req: &Request,
        held: Option<Arc<InFlight>>,
    ) -> (Pending, u64, OnReply) {
        let slot = Arc::new(Slot {
            value: Mutex::new(None),
            ready: Condvar::new(),
        });
        let filled = slot.clone();
        let on_reply: OnReply = Box::new(move |r| {
            *filled.value.lock() = Some(r.and_then(value_of));
            filled.ready.notify_all();
            drop(held);
        });
        let id = client.next_id();
        let pending = Pending {
            slot,
            client: client.clone(),
            id,
            op: req.op_name(),
            deadline: Instant::now() + client.config().request_timeout,
        };
        (pending, id, on_reply)
    }

    /// Sends `req` from this thread, with the GIL released, and returns once it is written.
    fn send(py: Python<'_>, client: &RustClient, req: Request) -> Pending {
        let (pending, id, on_reply) = Pending::new(client, &req, None);
        let c = client.clone();
        py.detach(move || runtime().block_on(c.send(id, &req, on_reply)));
        pending
    }

    /// Like [`Pending::send`], but the write itself runs on the client's runtime: the caller
    /// never waits, not even for a large frame to reach a kvd that stopped reading. `held` is
    /// dropped once the write is over and the reply has come, failed or been given up on.
    fn spawn(client: &RustClient, req: Request, held: Arc<InFlight>) -> Pending {
        let (pending, id, on_reply) = Pending::new(client, &req, Some(held.clone()));
        let c = client.clone();
        runtime().spawn(async move {
            c.send(id, &req, on_reply).await;
            drop(held);
        });
        pending
    }

    /// Past the request's deadline with no reply: record the timeout (once).
    fn expire(&self, v: &mut Option<Result<Value, ClientError>>) {
        if v.is_none() && Instant::now() >= self.deadline {
            self.client.forget(self.id);
            *v = Some(Err(ClientError::Timeout {
                op: self.op,
                after: self.client.config().request_timeout,
            }));
        }
    }
}

#[pymethods]
impl Pending {
    /// Whether the reply has arrived, or the request has timed out (never blocks).
    fn done(&self) -> bool {
        let mut v = self.slot.value.lock();
        self.expire(&mut v);
        v.is_some()
    }

    /// The reply, waiting up to `timeout` seconds (forever with None), and never past the
    /// client's request timeout. Lookups give `(hit_chunks, pin_id)`; stores and retrieves
    /// `(outcomes, done_slot)`, the outcomes as bytes (one code per chunk); releases the number
    /// of chunk pins dropped; events `(records, next, dropped)`; a remember the prompts its group
    /// holds; a recall `(prompt, prompts)`, the prompt `(salt, tokens, age_ms)` or None.
    #[pyo3(signature = (timeout = None))]
    fn result(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<Py<PyAny>> {
        let ready = py.detach(|| {
            let mut v = self.slot.value.lock();
            let wanted = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
            let until = match wanted {
                Some(w) if w < self.deadline => w,
                _ => self.deadline,
            };
            while v.is_none() {
                if self.slot.ready.wait_until(&mut v, until).timed_out() {
                    break;
                }
            }
            self.expire(&mut v);
            v.is_some()
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
            Ok(Value::Events {
                records,
                next,
                dropped,
            }) => Ok((records.clone(), *next, *dropped)
                .into_pyobject(py)?
                .into_any()
                .unbind()),
            Ok(Value::Remembered(n)) => Ok(n.into_pyobject(py)?.into_any().unbind()),
            Ok(Value::Recalled { prompt, prompts }) => Ok((prompt.clone(), *prompts)
                .into_pyobject(py)?
                .into_any()
                .unbind()),
            Err(e) => Err(client_error(e.clone())),
        }
    }
}

/// A connection to kvd.
#[pyclass(module = "kvd._native", frozen)]
pub(crate) struct Client {
    pub(crate) inner: RustClient,
    /// kvd's presence filter, when kvd keeps one and this process can map it (same host).
    presence: Option<Filter>,
    /// Why the filter kvd named could not be mapped.
    presence_error: Option<String>,
    /// Unread lookups sent and not yet answered ([`Client::lookup_unread`]).
    unread: Arc<AtomicUsize>,
    /// Remembers sent and not yet answered ([`Client::remember`]).
    remembering: Arc<AtomicUsize>,
}

/// Most unread lookups in flight on one client: past it they are not sent (they only teach
/// kvd; a kvd that stops answering must not grow the client's memory).
const MAX_UNREAD: usize = 64;

/// Most remembers (up to a frame each) a client has in flight: written or being written, and
/// not yet answered (or given up on).
const MAX_REMEMBERING: usize = 16;

/// One request counted in flight; dropping it (its last holder) uncounts it.
struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A lookup of the prefix, or with `last` of a state group's last chunk.
fn lookup_request(l: Lookup, last: bool) -> Request {
    if last {
        Request::LookupLast(l)
    } else {
        Request::Lookup(l)
    }
}

fn chunk_blocks(chunks: Vec<(u128, Vec<u32>)>) -> Vec<ChunkBlocks> {
    chunks
        .into_iter()
        .map(|(hash, blocks)| ChunkBlocks { hash, blocks })
        .collect()
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
        let named = inner.server().presence.clone();
        let (presence, presence_error) = if named.is_empty() {
            (None, None)
        } else {
            match Filter::open(&named) {
                Ok(f) => (Some(f), None),
                // kvd on another host, or in a container whose /dev/shm is not this one's:
                // every lookup asks kvd, as without a filter.
                Err(e) => (None, Some(e)),
            }
        };
        Ok(Client {
            inner,
            presence,
            presence_error,
            unread: Arc::new(AtomicUsize::new(0)),
            remembering: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// What kvd said in its hello: chunk_tokens, fd_socket, session_timeout_ms, server_version,
    /// session_id, protocol_version, presence, max_frame_bytes.
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
        d.set_item("presence", &h.presence)?;
        d.set_item("max_frame_bytes", h.max_frame_bytes)?;
        Ok(d)
    }

    /// The presence filter this client reads (the file kvd named), or None: kvd keeps none
    /// (a disk or L2 tier, `--presence-dir off`) or it could not be mapped
    /// (`presence_error` says why).
    #[getter]
    fn presence(&self) -> Option<&str> {
        self.presence.as_ref().map(Filter::path)
    }

    /// Why the filter kvd named could not be mapped, if it could not.
    #[getter]
    fn presence_error(&self) -> Option<&str> {
        self.presence_error.as_deref()
    }

    /// The position of the first of `hashes` kvd certainly does not hold on `shard`, as its
    /// presence filter says without asking kvd (`len(hashes)`: it may hold them all); None
    /// without a filter. Never blocks.
    fn first_absent(
        &self,
        fingerprint: u64,
        salt: u64,
        shard: u32,
        hashes: Vec<u128>,
    ) -> Option<usize> {
        self.presence
            .as_ref()
            .map(|f| f.first_absent(fingerprint, salt, shard, &hashes))
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
    /// retrieved by `readers` ranks per shard, released, or timed out. With `last`, the last
    /// of `hashes` stored instead (a state group's chunk stands alone), pinned alone: the hit is
    /// its position + 1. `held`: leading chunks the caller holds already and will not load
    /// (vLLM's own prefix cache): kvd pins none of them and reads none back from its disk,
    /// and one it has only on disk still counts towards the hit (0 with `last`).
    #[pyo3(signature = (fingerprint, salt, shards, hashes, pin = true, readers = 1, last = false, held = 0))]
    #[allow(clippy::too_many_arguments)]
    fn lookup(
        &self,
        py: Python<'_>,
        fingerprint: u64,
        salt: u64,
        shards: Vec<u32>,
        hashes: Vec<u128>,
        pin: bool,
        readers: u16,
        last: bool,
        held: u32,
    ) -> Pending {
        let l = Lookup {
            fingerprint,
            salt,
            shards,
            hashes,
            pin,
            readers,
            held,
        };
        Pending::send(py, &self.inner, lookup_request(l, last))
    }

    /// An unpinned lookup whose reply nobody reads: kvd learns the prompt (the parent of the
    /// chunk a later store begins with, and that what it holds of the prompt was read) while the
    /// caller goes on at once. It is written by the client's own threads, so that the caller
    /// pays neither the write nor waking kvd. For a lookup kvd's presence filter has answered.
    /// Returns whether it was sent: not while [`MAX_UNREAD`] are unanswered.
    #[pyo3(signature = (fingerprint, salt, shards, hashes, readers = 1, last = false, held = 0))]
    #[allow(clippy::too_many_arguments)]
    fn lookup_unread(
        &self,
        fingerprint: u64,
        salt: u64,
        shards: Vec<u32>,
        hashes: Vec<u128>,
        readers: u16,
        last: bool,
        held: u32,
    ) -> bool {
        if self.unread.fetch_add(1, Ordering::AcqRel) >= MAX_UNREAD {
            self.unread.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        let req = lookup_request(
            Lookup {
                fingerprint,
                salt,
                shards,
                hashes,
                pin: false,
                readers,
                held,
            },
            last,
        );
        let (c, unread) = (self.inner.clone(), self.unread.clone());
        let id = c.next_id();
        // Its reply, or the connection's failure, ends it.
        let done: OnReply = Box::new(move |_| {
            unread.fetch_sub(1, Ordering::AcqRel);
        });
        runtime().spawn(async move { c.send(id, &req, done).await });
        true
    }

    /// The removal feed: chunks that left kvd's pool after sequence number `since` (0: the
    /// oldest kvd still holds; past kvd's newest, e.g. 2**64-1: from now), at most `max` of them
    /// (kvd sends at most 4096). Gives `(records, next, dropped)`: each record `(fingerprint,
    /// salt, shard, hash)`, oldest first; `next` to pass as `since` next time; `dropped`, the
    /// records after `since` kvd had already overwritten (nonzero: removals were missed).
    fn events(&self, py: Python<'_>, since: u64, max: u32) -> Pending {
        Pending::send(py, &self.inner, Request::Events(Events { since, max }))
    }

    /// Keeps a served prompt in kvd under `group` (the replica's name, `kvd.warm_group`), for
    /// warming its replacement (`kvd.warm`). `tokens` are the prompt's token ids as native
    /// 32-bit unsigned integers (`array.array("I", ids).tobytes()`); `salt` its `cache_salt`
    /// ("" for none). Never waits: the frame is written from the client's runtime; None
    /// (nothing sent) while [`MAX_REMEMBERING`] remembers are unanswered. The Pending gives the
    /// prompts the group holds.
    fn remember(&self, group: String, salt: String, tokens: &[u8]) -> PyResult<Option<Pending>> {
        if !tokens.len().is_multiple_of(4) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "tokens must be 32-bit token ids: pass array.array('I', ids).tobytes()",
            ));
        }
        if self.remembering.fetch_add(1, Ordering::AcqRel) >= MAX_REMEMBERING {
            self.remembering.fetch_sub(1, Ordering::AcqRel);
            return Ok(None);
        }
        let tokens = tokens
            .chunks_exact(4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok(Some(Pending::spawn(
            &self.inner,
            Request::Remember(Remember {
                group,
                salt,
                tokens,
            }),
            Arc::new(InFlight(self.remembering.clone())),
        )))
    }

    /// The `index`-th newest prompt `group` holds (0 the newest): gives `(prompt, prompts)`,
    /// the prompt `(salt, tokens, age_ms)` or None past the group's last.
    fn recall(&self, py: Python<'_>, group: String, index: u32) -> Pending {
        Pending::send(py, &self.inner, Request::Recall(Recall { group, index }))
    }

    /// Drops a lookup pin.
    fn release(&self, py: Python<'_>, pin_id: u64) -> Pending {
        Pending::send(py, &self.inner, Request::Release(Release { pin_id }))
    }

    /// Copies chunks `(hash, block_ids)` from the registered cache into kvd, after the client
    /// event `wait_slot` (if any). Outcomes: 0 stored, 1 already stored, 2 refused (pool full),
    /// 3 skipped. With `deadline_ns` (`time.monotonic_ns()` when the blocks may be reused), kvd
    /// never starts the copy after it: such a store fails with `Expired`, nothing copied.
    #[pyo3(signature = (region, salt, chunks, wait_slot = None, deadline_ns = 0))]
    fn store(
        &self,
        py: Python<'_>,
        region: u32,
        salt: u64,
        chunks: Vec<(u128, Vec<u32>)>,
        wait_slot: Option<u16>,
        deadline_ns: u64,
    ) -> Pending {
        let req = Request::Store(Store {
            region,
            salt,
            chunks: chunk_blocks(chunks),
            wait_slot,
            deadline_ns,
        });
        Pending::send(py, &self.inner, req)
    }

    /// Copies chunks from kvd into `(hash, block_ids)` of the registered cache (a block id of
    /// 0xFFFFFFFF is left untouched). Outcomes: 0 loaded, 1 missing. With `deadline_ns`
    /// (`time.monotonic_ns()` after which the blocks go to other work), kvd never starts the
    /// copy after it: such a retrieve fails with `Expired`, nothing written.
    #[pyo3(signature = (region, salt, chunks, pin_id = 0, wait_slot = None, deadline_ns = 0))]
    #[allow(clippy::too_many_arguments)]
    fn retrieve(
        &self,
        py: Python<'_>,
        region: u32,
        salt: u64,
        chunks: Vec<(u128, Vec<u32>)>,
        pin_id: u64,
        wait_slot: Option<u16>,
        deadline_ns: u64,
    ) -> Pending {
        let req = Request::Retrieve(Retrieve {
            region,
            salt,
            pin_id,
            chunks: chunk_blocks(chunks),
            wait_slot,
            deadline_ns,
        });
        Pending::send(py, &self.inner, req)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lookup_gives_its_hit_and_pin() {
        let r = Reply::Lookup(LookupReply {
            hit_chunks: 3,
            pin_id: 42,
        });
        assert_eq!(value_of(r).unwrap(), Value::Lookup { hit: 3, pin_id: 42 });
    }

    #[test]
    fn copy_outcomes_are_the_wire_codes_python_compares_with() {
        // kvd._native.STORED etc. are these same casts (lib.rs): the Pending's bytes must match.
        let store = Reply::Store(StoreReply {
            outcomes: vec![
                StoreOutcome::Stored,
                StoreOutcome::AlreadyStored,
                StoreOutcome::RefusedPoolFull,
                StoreOutcome::Skipped,
            ],
            done_slot: Some(5),
        });
        assert_eq!(
            value_of(store).unwrap(),
            Value::Copy {
                outcomes: vec![0, 1, 2, 3],
                done_slot: Some(5)
            }
        );
        let retrieve = Reply::Retrieve(RetrieveReply {
            outcomes: vec![RetrieveOutcome::Missing, RetrieveOutcome::Loaded],
            done_slot: None,
        });
        assert_eq!(
            value_of(retrieve).unwrap(),
            Value::Copy {
                outcomes: vec![1, 0],
                done_slot: None
            }
        );
    }

    #[test]
    fn a_release_gives_the_pins_it_dropped() {
        let r = Reply::Released(Released { chunks: 7 });
        assert_eq!(value_of(r).unwrap(), Value::Released(7));
    }

    #[test]
    fn events_give_each_record_as_the_client_keyed_it() {
        let r = Reply::Events(EventsReply {
            records: vec![RemovedChunk {
                fingerprint: 1,
                salt: 2,
                shard: 3,
                hash: u128::MAX - 4,
            }],
            next: 9,
            dropped: 5,
        });
        assert_eq!(
            value_of(r).unwrap(),
            Value::Events {
                records: vec![(1, 2, 3, u128::MAX - 4)],
                next: 9,
                dropped: 5
            }
        );
    }

    #[test]
    fn an_error_reply_keeps_its_code_and_message() {
        let r = Reply::Error(ErrorReply {
            code: ErrorCode::Busy,
            message: "copy queue full".into(),
        });
        match value_of(r) {
            Err(ClientError::Server { code, message }) => {
                assert_eq!(code, ErrorCode::Busy);
                assert_eq!(message, "copy queue full");
            }
            other => panic!("expected a server error, got {other:?}"),
        }
    }

    #[test]
    fn a_reply_of_another_kind_is_a_protocol_error_naming_it() {
        let r = Reply::Pong(Pong { uptime_ms: 1 });
        match value_of(r) {
            Err(ClientError::Protocol(what)) => assert!(what.contains("Pong"), "{what}"),
            other => panic!("expected a protocol error, got {other:?}"),
        }
    }
}
