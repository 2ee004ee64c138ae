//! What `/healthz` says. It tells the truth: 200 only when the pool's first slabs are ready
//! (populated, and pinned where a GPU driver is present) and the server loop answers a probe
//! (taking the session and cache locks every request takes) within a second; otherwise 503
//! with a JSON reason. The rest of the pool grows in the background; the `pool` field says how
//! far (ready and total bytes, growth rate, and why it stopped if it did). The tiers below L1
//! are reported, never a reason for 503.

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use serde_json::json;
use tokio::sync::{mpsc, oneshot};

use crate::control::state::{Phase, State};
use crate::ops::http::Site;

/// How long the control loop has to answer a health probe.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Sends a probe into the control loop and waits for its answer.
pub type Prober = mpsc::Sender<oneshot::Sender<()>>;

/// kvd's HTTP site: `/healthz` from the state and a probe of the control loop, `/metrics`
/// from the registry.
#[derive(Debug)]
pub struct Health {
    /// What is reported.
    pub state: Arc<State>,
    /// Into the control loop.
    pub prober: Prober,
}

impl Site for Health {
    fn health(&self) -> BoxFuture<'_, (u16, String)> {
        Box::pin(verdict(&self.state, &self.prober))
    }

    fn metrics(&self) -> String {
        self.state.refresh_metrics();
        self.state.metrics.render()
    }
}

/// The verdict: status code and JSON body.
pub async fn verdict(state: &State, prober: &Prober) -> (u16, String) {
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
    let s = state.l1.cache().stats();
    let g = state.l1.growth();
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
    let tiers = state.tiers.get();
    let l2 = match tiers.and_then(|t| t.l2.as_ref()) {
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
    let disk = match tiers.and_then(|t| t.disk.as_ref()) {
        None => json!({ "state": "off" }),
        Some(d) => {
            let h = d.health();
            let ix = d.index.lock();
            json!({
                "state": h.state,
                "last_error": h.last_error,
                "last_error_age_s": h.last_error_age_s,
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
