//! HTTP: `/healthz` and `/metrics`. A deliberately small HTTP/1.1 responder — two GET routes,
//! one request per connection, head read bounded in size and time — so that probes and scrapes
//! need no framework.
//!
//! At most [`MAX_CONNECTIONS`] connections are open at once, each for at most
//! [`CONNECTION_TIMEOUT`] in all; when the table is full a new connection closes the oldest, so
//! slow or silent clients can neither exhaust kvd's descriptors nor keep probes out for long.
//!
//! What the routes answer is the [`Site`]'s: the server gives its own (`/healthz`'s verdict is
//! [`crate::life::health`]'s), so this responder knows nothing of what it reports.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use futures_util::future::BoxFuture;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::accept::accept_until;

const MAX_HEAD_BYTES: usize = 8192;
const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// Most HTTP connections open at once (within the descriptors kvd keeps spare).
pub const MAX_CONNECTIONS: usize = 64;
/// Longest one HTTP exchange may take, reading and writing.
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);
/// What the routes answer.
pub trait Site: Send + Sync + 'static {
    /// `/healthz`: the status code and the JSON body.
    fn health(&self) -> BoxFuture<'_, (u16, String)>;
    /// `/metrics`: the Prometheus text, brought up to date.
    fn metrics(&self) -> String;
}

/// Serves HTTP until `stop`.
pub async fn serve(
    listener: TcpListener,
    site: Arc<dyn Site>,
    stop: CancellationToken,
    tracker: TaskTracker,
) {
    let open: Arc<Mutex<VecDeque<(u64, CancellationToken)>>> = Arc::default();
    let next = AtomicU64::new(0);
    accept_until(
        "http",
        stop,
        tracker,
        || async { listener.accept().await.map(|(s, _)| s) },
        move |stream| {
            let site = site.clone();
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
                    r = tokio::time::timeout(CONNECTION_TIMEOUT, connection(stream, &*site)) => match r {
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

async fn connection(mut stream: TcpStream, site: &dyn Site) -> std::io::Result<()> {
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
            let (code, body) = site.health().await;
            respond(&mut stream, code, "application/json", &body, head_only).await
        }
        "/metrics" => {
            let body = site.metrics();
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
