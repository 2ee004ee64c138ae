//! The L2 tier's metrics, prefixed `kvd_l2_`, in kvd's one registry.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge};

use crate::metrics::{counter, counter_vec, gauge, Metrics};

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
    /// Values rejected, by reason (truncated, version, foreign, length, corrupt).
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
        let l2 = L2Metrics {
            up: gauge(r, "kvd_l2_up", "1 while the L2 tier answers its health probe."),
            lookup_chunks: counter_vec(r, "kvd_l2_lookup_chunks_total", "Chunks lookups asked L2 for (after missing L1), by result (hit, miss).", &["result"]),
            lookup_timeouts: counter(r, "kvd_l2_lookup_timeouts_total", "Lookups whose L2 round trip missed --l2-deadline-ms and were answered from L1 alone."),
            bytes: counter_vec(r, "kvd_l2_bytes_total", "Chunk bytes moved to and from L2, by direction (read, write).", &["direction"]),
            queued: counter(r, "kvd_l2_write_behind_queued_total", "Stored chunks accepted into the write-behind queue."),
            write_behind: counter_vec(r, "kvd_l2_write_behind_total", "Write-behind chunks by outcome (written, dropped_queue_full, dropped_evicted, failed).", &["outcome"]),
            rejected: counter_vec(r, "kvd_l2_rejected_values_total", "L2 values refused before reaching L1, by reason (truncated, version, foreign, length, corrupt).", &["reason"]),
            errors: counter_vec(r, "kvd_l2_errors_total", "L2 operation errors, by op and kind (unavailable, full, failed).", &["op", "kind"]),
            fill_chunks: counter_vec(r, "kvd_l2_fill_chunks_total", "L2 hits put into L1 pages, by outcome (filled, present, refused_pool_full).", &["outcome"]),
            fetch_seconds: fetch,
        };
        l2.init_labels();
        l2
    }

    /// Creates every labelled series at zero, as kvd's own families are, so dashboards and
    /// alerts find them on an idle kvd.
    fn init_labels(&self) {
        let families: [(&IntCounterVec, &[&str]); 5] = [
            (&self.lookup_chunks, &["hit", "miss"]),
            (&self.bytes, &["read", "write"]),
            (
                &self.write_behind,
                &["written", "dropped_queue_full", "dropped_evicted", "failed"],
            ),
            (
                &self.rejected,
                &["truncated", "version", "foreign", "length", "corrupt"],
            ),
            (
                &self.fill_chunks,
                &["filled", "present", "refused_pool_full"],
            ),
        ];
        for (family, values) in families {
            for v in values {
                drop(family.with_label_values(&[v]));
            }
        }
        for op in ["get", "set", "ping"] {
            for kind in ["unavailable", "full", "failed"] {
                drop(self.errors.with_label_values(&[op, kind]));
            }
        }
    }
}
