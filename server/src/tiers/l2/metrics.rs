//! The L2 tier's metrics, prefixed `kvd_l2_`, in kvd's one registry.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge};

use crate::ops::metrics::{counter, counter_vec, gauge, Metrics};
use crate::tiers::value::Rejected;

/// Every L2 metric.
#[derive(Debug, Clone)]
pub struct L2Metrics {
    /// 1 while L2 answers.
    pub up: IntGauge,
    /// Chunks lookups asked L2 for, by result (hit, miss).
    pub lookup_chunks: IntCounterVec,
    /// Lookups whose L2 round trip missed the deadline.
    pub lookup_timeouts: IntCounter,
    /// Bytes moved, by direction (read, write).
    pub bytes: IntCounterVec,
    /// Chunks accepted into the write-behind queue.
    pub queued: IntCounter,
    /// Write-behind chunks by outcome (written, dropped_queue_full, dropped_evicted, failed).
    pub write_behind: IntCounterVec,
    /// Values rejected, by reason (see [`Rejected`]).
    pub rejected: IntCounterVec,
    /// Operation errors, by op and kind.
    pub errors: IntCounterVec,
    /// L2 hits put into L1 pages, by outcome (filled, present, refused_pool_full).
    pub fill_chunks: IntCounterVec,
    /// Time from a lookup's L2 request to its hits being in L1.
    pub fetch_seconds: Histogram,
}

impl L2Metrics {
    /// Registers the L2 metrics beside kvd's others.
    pub fn new(m: &Metrics) -> L2Metrics {
        let r = m.registry();
        let fetch = Histogram::with_opts(
            HistogramOpts::new(
                "kvd_l2_fetch_duration_seconds",
                "Time from a lookup's L2 request until its hits are in L1 pages.",
            )
            .buckets(prometheus::exponential_buckets(1e-4, 2.0, 16).expect("buckets")),
        )
        .expect("valid metric");
        r.register(Box::new(fetch.clone())).expect("unique metric");
        let m = L2Metrics {
            up: gauge(r, "kvd_l2_up", "1 while the L2 tier answers its health probe."),
            lookup_chunks: counter_vec(r, "kvd_l2_lookup_chunks_total", "Chunks lookups asked L2 for (after missing L1), by result (hit, miss).", &["result"]),
            lookup_timeouts: counter(r, "kvd_l2_lookup_timeouts_total", "Lookups whose L2 round trip missed --l2-deadline-ms and were answered from L1 alone."),
            bytes: counter_vec(r, "kvd_l2_bytes_total", "Chunk bytes moved to and from L2, by direction (read, write).", &["direction"]),
            queued: counter(r, "kvd_l2_write_behind_queued_total", "Stored chunks accepted into the write-behind queue."),
            write_behind: counter_vec(r, "kvd_l2_write_behind_total", "Write-behind chunks by outcome (written, dropped_queue_full, dropped_evicted, failed).", &["outcome"]),
            rejected: counter_vec(r, "kvd_l2_rejected_values_total", "L2 values refused before reaching L1, by reason (truncated, version, foreign, length, corrupt, unauthenticated, forged, needs_secret).", &["reason"]),
            errors: counter_vec(r, "kvd_l2_errors_total", "L2 operation errors, by op and kind (unavailable, full, failed).", &["op", "kind"]),
            fill_chunks: counter_vec(r, "kvd_l2_fill_chunks_total", "L2 hits put into L1 pages, by outcome (filled, present, refused_pool_full).", &["outcome"]),
            fetch_seconds: fetch,
        };
        m.export_every_label();
        m
    }

    /// Creates every series at 0, so that dashboards and alerts see each family and label
    /// from the start rather than after its first event.
    fn export_every_label(&self) {
        let zero = |v: &IntCounterVec, labels: &[&[&str]]| {
            for l in labels {
                v.with_label_values(l).inc_by(0);
            }
        };
        zero(&self.lookup_chunks, &[&["hit"], &["miss"]]);
        zero(&self.bytes, &[&["read"], &["write"]]);
        zero(
            &self.write_behind,
            &[
                &["written"],
                &["dropped_queue_full"],
                &["dropped_evicted"],
                &["failed"],
            ],
        );
        for r in Rejected::ALL {
            self.rejected.with_label_values(&[r.label()]).inc_by(0);
        }
        for op in OPS {
            for kind in KINDS {
                self.errors.with_label_values(&[op, kind]).inc_by(0);
            }
        }
        zero(
            &self.fill_chunks,
            &[&["filled"], &["present"], &["refused_pool_full"]],
        );
    }
}

/// The `op` labels of `kvd_l2_errors_total`.
pub const OPS: [&str; 2] = ["get", "set"];
/// The `kind` labels of `kvd_l2_errors_total`.
pub const KINDS: [&str; 3] = ["unavailable", "full", "failed"];
