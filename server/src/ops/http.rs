//! HTTP: `/healthz` and `/metrics`. A deliberately small HTTP/1.1 responder — two GET routes,
//! one request per connection, head read bounded in size and time — so that probes and scrapes
//! need no framework.
//!
//! At most [`MAX_CONNECTIONS`] connections are open at once, each for at most
//! [`CONNECTION_TIMEOUT`] in all; when the table is full a new connection closes the oldest, so
//! slow or silent clients can neither exhaust kvd's descriptors nor keep probes out for long.
//!
//! `/healthz` tells the truth: 200 only when the pool's first slabs are ready (populated, and
//! pinned where a GPU driver is present) and the server loop answers a probe (taking the session
//! and cache locks every request takes) within a second; otherwise 503 with a JSON reason. The
//! rest of the pool grows in the background; the `pool` field says how far (ready and total
//! bytes, growth rate, and why it stopped if it did).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::control::state::{Phase, State};

const MAX_HEAD_BYTES: usize = 8192;
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Most HTTP connections open at once (within the descriptors kvd keeps spare).
pub const MAX_CONNECTIONS: usize = 64;
/// Longest one HTTP exchange may take, reading and writing.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the control loop has to answer a health probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Sends a probe into the control loop and waits for its answer.
pub type Prober = mpsc::Sender<oneshot::Sender<()>>;

/// Serves HTTP until `stop`.
pub async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    prober: Prober,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let open: Arc<Mutex<VecDeque<(u64, CancellationToken)>>> = Arc::default();
    let next = AtomicU64::new(0);
    crate::ops::accept::accept_until(
        "http",
        stop,
        tracker,
        || async { listener.accept().await.map(|(s, _)| s) },
        move |stream| {
            let state = state.clone();
            let prober = prober.clone();
            let id = next.fetch_add(1, Ordering::Relaxed);
            let close = CancellationToken::new();
            {
                let mut o = open.lock();
                if o.len() >= MAX_CONNECTIONS {
                    if let Some((_, oldest)) = o.pop_front() {
                        oldest.cancel();
                    }
                }
                o.push_back((id, close.clone()));
            }
            let open = open.clone();
            async move {
                tokio::select! {
                    _ = close.cancelled() => tracing::debug!("http connection closed for a newer one"),
                    r = tokio::time::timeout(CONNECTION_TIMEOUT, connection(stream, &state, &prober)) => match r {
                        Ok(Err(e)) => tracing::debug!("http connection: {e}"),
                        Err(_) => tracing::debug!("http connection took over {CONNECTION_TIMEOUT:?}"),
                        Ok(Ok(())) => {}
                    },
                }
                open.lock().retain(|(i, _)| *i != id);
            }
        },
    )
    .await
}

async fn read_head(stream: &mut TcpStream) -> std::io::Result<Option<String>> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.windows(2).any(|w| w == b"\n\n") {
            return Ok(Some(String::from_utf8_lossy(&buf).into_owned()));
        }
        if buf.len() >= MAX_HEAD_BYTES {
            return Ok(None);
        }
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(None);
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

async fn connection(mut stream: TcpStream, state: &State, prober: &Prober) -> std::io::Result<()> {
    let head = match tokio::time::timeout(READ_TIMEOUT, read_head(&mut stream)).await {
        Ok(r) => r?,
        Err(_) => return Ok(()),
    };
    let Some(head) = head else {
        return respond(&mut stream, 400, "text/plain", "bad request\n", false).await;
    };
    let mut parts = head.lines().next().unwrap_or_default().split_whitespace();
    let (method, target) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let head_only = method == "HEAD";
    if method != "GET" && !head_only {
        return respond(&mut stream, 405, "text/plain", "only GET and HEAD\n", false).await;
    }
    let path = target.split('?').next().unwrap_or_default();
    match path {
        "/healthz" => {
            let (code, body) = health(state, prober).await;
            respond(&mut stream, code, "application/json", &body, head_only).await
        }
        "/metrics" => {
            state.refresh_metrics();
            let body = state.metrics.render();
            respond(
                &mut stream,
                200,
                "text/plain; version=0.0.4",
                &body,
                head_only,
            )
            .await
        }
        "/" => {
            respond(
                &mut stream,
                200,
                "text/plain",
                "kvd: GET /healthz, GET /metrics\n",
                head_only,
            )
            .await
        }
        _ => {
            respond(
                &mut stream,
                404,
                "text/plain",
                "not found; try /healthz or /metrics\n",
                head_only,
            )
            .await
        }
    }
}

/// The health verdict: status code and JSON body.
pub async fn health(state: &State, prober: &Prober) -> (u16, String) {
    let phase = state.phase();
    let not_ready = |status: &str, extra: serde_json::Value| {
        let mut body = json!({ "status": status });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        state.metrics.ready.set(0);
        (503, body.to_string())
    };
    match phase {
        Phase::Starting => return not_ready("starting", json!({ "reason": "binding sockets" })),
        Phase::Populating { fraction, gb_per_s } => {
            return not_ready(
                "populating",
                json!({ "reason": "first-touching the L1 pool", "progress": (fraction * 1000.0).round() / 1000.0, "gb_per_s": (gb_per_s * 10.0).round() / 10.0 }),
            )
        }
        Phase::Pinning => {
            return not_ready(
                "pinning",
                json!({ "reason": "registering the L1 pool with the GPU driver" }),
            )
        }
        Phase::Failed(e) => return not_ready("failed", json!({ "reason": e })),
        Phase::ShuttingDown => {
            return not_ready("shutting_down", json!({ "reason": "kvd is exiting" }))
        }
        Phase::Ready => {}
    }
    let (tx, rx) = oneshot::channel();
    let answered = prober.try_send(tx).is_ok()
        && tokio::time::timeout(PROBE_TIMEOUT, rx)
            .await
            .is_ok_and(|r| r.is_ok());
    if !answered {
        return not_ready(
            "stuck",
            json!({ "reason": format!("the server loop did not answer a probe (with the session and cache locks) within {} ms", PROBE_TIMEOUT.as_millis()) }),
        );
    }
    state.metrics.ready.set(1);
    let s = state.cache.lock().stats();
    let g = state.growth.lock().clone();
    let mut pool = json!({
        "state": g.state(),
        "ready_bytes": s.capacity_bytes,
        "total_bytes": s.total_bytes,
        "gb_per_s": (g.gb_per_s * 10.0).round() / 10.0,
    });
    if let Some(obj) = pool.as_object_mut() {
        if let Some(full) = g.full_after {
            obj.insert(
                "full_after_s".into(),
                json!((full.as_secs_f64() * 100.0).round() / 100.0),
            );
        }
        if let Some(e) = g.error {
            obj.insert("error".into(), json!(e));
        }
    }
    // L2 is optional: its state is reported, never a reason for 503.
    let l2 = match state.tier.get() {
        None => json!({ "state": "off" }),
        Some(t) => {
            let h = t.health();
            json!({
                "state": h.state,
                "url": t.config.url,
                "last_error": h.last_error,
                "last_error_age_s": h.last_error_age_s,
                "last_error_current": h.last_error_current,
            })
        }
    };
    // The disk tier is optional too: a failed or full drive is reported, never a 503.
    let disk = match state.disk.get() {
        None => json!({ "state": "off" }),
        Some(d) => {
            let h = d.health();
            let ix = d.index.lock();
            json!({
                "state": h.state,
                "last_error": h.last_error,
                "chunks": ix.len(),
                "used_bytes": ix.used_bytes(),
                "capacity_bytes": ix.capacity_bytes(),
                "drives": h.drives.iter().map(|d| json!({
                    "path": d.path,
                    "state": d.state,
                    "direct": d.direct,
                    "capacity_bytes": d.capacity_bytes,
                    "error": d.error,
                })).collect::<Vec<_>>(),
            })
        }
    };
    (
        200,
        json!({
            "status": "ok",
            "pool_bytes": s.total_bytes,
            "pool_used_bytes": s.usage.used_bytes,
            "pool_pinned": state.metrics.pool_pinned.get() == 1,
            "pool": pool,
            "uptime_s": state.started.elapsed().as_secs(),
            "l2": l2,
            "disk": disk,
        })
        .to_string(),
    )
}

async fn respond(
    stream: &mut TcpStream,
    code: u16,
    content_type: &str,
    body: &str,
    head_only: bool,
) -> std::io::Result<()> {
    let reason = match code {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        _ => "Service Unavailable",
    };
    let head = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    if !head_only {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}
