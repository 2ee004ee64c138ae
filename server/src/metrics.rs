//! Prometheus metrics, all prefixed `kvd_`. Counters that the cache keeps itself (evictions,
//! refusals, expired pins) are brought up to date at scrape time, so the hot path touches no
//! metric it does not own.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

use crate::cache::CacheStats;

/// Every metric kvd exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Pool size.
    pub pool_bytes: IntGauge,
    /// Bytes in pages holding or receiving chunks.
    pub pool_used_bytes: IntGauge,
    /// Pages with a pin.
    pub pinned_pages: IntGauge,
    /// Stored chunks.
    pub chunks: IntGauge,
    /// Lookup pins held.
    pub lookup_pins: IntGauge,
    /// Lookups by result (hit: at least one chunk).
    pub lookups: IntCounterVec,
    /// Looked-up chunks by result.
    pub lookup_chunks: IntCounterVec,
    /// Store chunks by outcome.
    pub store_chunks: IntCounterVec,
    /// Retrieve chunks by outcome.
    pub retrieve_chunks: IntCounterVec,
    /// Evictions.
    pub evictions: IntCounter,
    /// Lookup pins that timed out.
    pub pins_expired: IntCounter,
    /// Bytes copied into the pool.
    pub bytes_stored: IntCounter,
    /// Bytes copied out of the pool.
    pub bytes_retrieved: IntCounter,
    /// Request latency by op.
    pub request_seconds: HistogramVec,
    /// Registered KV caches (worker registrations).
    pub registered_workers: IntGauge,
    /// Open sessions.
    pub sessions: IntGauge,
    /// Sessions closed for silence.
    pub sessions_timed_out: IntCounter,
    /// Frames that could not be decoded, by reason.
    pub malformed_frames: IntCounterVec,
    /// Error replies to decoded requests, by op and error code.
    pub request_errors: IntCounterVec,
    /// Registrations refused, by reason.
    pub registration_refusals: IntCounterVec,
    /// Copy jobs refused because a device queue was full.
    pub copy_queue_full: IntCounter,
    /// Copy jobs that failed on the device.
    pub copy_errors: IntCounter,
    /// Device resources whose release failed.
    pub gpu_release_errors: IntCounter,
    /// Copy jobs whose batch call the driver refused, copied run by run instead.
    pub copy_batch_fallbacks: IntCounter,
    /// Seconds the pool took to populate and pin.
    pub pool_ready_seconds: prometheus::Gauge,
    /// 1 when /healthz would answer 200.
    pub ready: IntGauge,
    /// Copy throughput per job, by direction.
    pub copy_seconds: HistogramVec,
    /// CPU time spent submitting a job to its device, by direction.
    pub copy_submit_seconds: HistogramVec,
    /// Whether the pool is pinned for DMA.
    pub pool_pinned: IntGauge,
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    registry
        .register(Box::new(c.clone()))
        .expect("unique metric");
    c
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    registry
        .register(Box::new(g.clone()))
        .expect("unique metric");
    g
}

fn counter_vec(registry: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    registry
        .register(Box::new(c.clone()))
        .expect("unique metric");
    c
}

fn histogram_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    buckets: Vec<f64>,
    label: &str,
) -> HistogramVec {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), &[label])
        .expect("valid metric");
    registry
        .register(Box::new(h.clone()))
        .expect("unique metric");
    h
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let r = Registry::new();
        let request_seconds = histogram_vec(
            &r,
            "kvd_request_duration_seconds",
            "Time from a request's arrival to its reply being queued, by op.",
            vec![
                5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                0.1, 0.5, 2.5,
            ],
            "op",
        );
        let copy_seconds = histogram_vec(
            &r,
            "kvd_copy_duration_seconds",
            "Time a copy job spent on its device, from submission to completion, by direction.",
            prometheus::exponential_buckets(1e-5, 2.5, 14).expect("buckets"),
            "direction",
        );
        let copy_submit_seconds = histogram_vec(
            &r,
            "kvd_copy_submit_duration_seconds",
            "CPU time a copy thread spent submitting a job to its device (descriptors and driver calls), by direction.",
            prometheus::exponential_buckets(1e-6, 2.5, 14).expect("buckets"),
            "direction",
        );
        let pool_ready_seconds = prometheus::Gauge::new(
            "kvd_pool_ready_seconds",
            "Seconds from start until the pool was populated and pinned.",
        )
        .expect("valid metric");
        r.register(Box::new(pool_ready_seconds.clone()))
            .expect("unique metric");
        Metrics {
            pool_bytes: gauge(&r, "kvd_pool_bytes", "L1 pool size in bytes."),
            pool_used_bytes: gauge(&r, "kvd_pool_used_bytes", "Pool bytes in pages that hold or are receiving chunks."),
            pinned_pages: gauge(&r, "kvd_pool_pinned_pages", "Pages held by a lookup pin or an in-flight copy."),
            chunks: gauge(&r, "kvd_pool_chunks", "Chunks stored or being stored."),
            lookup_pins: gauge(&r, "kvd_lookup_pins", "Lookup pins held."),
            lookups: counter_vec(&r, "kvd_lookups_total", "Lookups, by result (hit: at least one chunk).", &["result"]),
            lookup_chunks: counter_vec(&r, "kvd_lookup_chunks_total", "Chunks asked for by lookups, by result.", &["result"]),
            store_chunks: counter_vec(&r, "kvd_store_chunks_total", "Chunks in store requests, by outcome (stored, already_stored, refused_pool_full, skipped).", &["outcome"]),
            retrieve_chunks: counter_vec(&r, "kvd_retrieve_chunks_total", "Chunks in retrieve requests, by outcome (loaded, missing).", &["outcome"]),
            evictions: counter(&r, "kvd_evictions_total", "Chunks evicted to make room."),
            pins_expired: counter(&r, "kvd_pins_expired_total", "Lookup pins that timed out before a retrieve or release."),
            bytes_stored: counter(&r, "kvd_bytes_stored_total", "Bytes copied from clients into the pool."),
            bytes_retrieved: counter(&r, "kvd_bytes_retrieved_total", "Bytes copied from the pool to clients."),
            request_seconds,
            registered_workers: gauge(&r, "kvd_registered_workers", "Registered KV caches."),
            sessions: gauge(&r, "kvd_sessions", "Open client sessions."),
            sessions_timed_out: counter(&r, "kvd_sessions_timed_out_total", "Sessions closed because the client went silent."),
            malformed_frames: counter_vec(&r, "kvd_malformed_frames_total", "Frames that could not be decoded, by reason.", &["reason"]),
            request_errors: counter_vec(&r, "kvd_request_errors_total", "Error replies to decoded requests, by op and code (malformed frames: kvd_malformed_frames_total).", &["op", "code"]),
            registration_refusals: counter_vec(&r, "kvd_registration_refusals_total", "Registrations refused, by reason (vmm_memory, invalid, device, fd_missing).", &["reason"]),
            copy_queue_full: counter(&r, "kvd_copy_queue_full_total", "Copy jobs refused because the device's queue was full."),
            copy_errors: counter(&r, "kvd_copy_errors_total", "Copy jobs that failed on the device."),
            gpu_release_errors: counter(&r, "kvd_gpu_release_errors_total", "Device resources (imports, events, registrations) whose release failed."),
            copy_batch_fallbacks: counter(&r, "kvd_copy_batch_fallbacks_total", "Copy jobs the driver's batch copy refused, copied run by run instead."),
            pool_ready_seconds,
            ready: gauge(&r, "kvd_ready", "1 when the pool is ready and the control loop answers."),
            copy_seconds,
            copy_submit_seconds,
            pool_pinned: gauge(&r, "kvd_pool_pinned", "1 when the pool is registered with a GPU driver for DMA."),
            registry: r,
        }
    }

    /// Brings pool gauges and cache-owned counters up to date.
    pub fn observe_cache(&self, s: &CacheStats) {
        self.pool_used_bytes.set(s.usage.used_bytes as i64);
        self.pinned_pages.set(s.pinned_pages as i64);
        self.chunks.set(s.entries as i64);
        self.lookup_pins.set(s.pin_sets as i64);
        catch_up(&self.evictions, s.counters.evictions);
        catch_up(&self.pins_expired, s.counters.pins_expired);
        catch_up(&self.gpu_release_errors, kvd_gpu::cuda::release_errors());
        catch_up(&self.copy_batch_fallbacks, kvd_gpu::cuda::batch_fallbacks());
    }

    /// A histogram timer for one op.
    pub fn request_timer(&self, op: &str) -> Histogram {
        self.request_seconds.with_label_values(&[op])
    }

    /// Records an answered request: its time, and its error code when it failed.
    pub fn answered(&self, op: &str, reply: &crate::wire::Reply, seconds: f64) {
        self.request_timer(op).observe(seconds);
        if let crate::wire::Reply::Error(e) = reply {
            self.request_errors
                .with_label_values(&[op, &format!("{:?}", e.code)])
                .inc();
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("text exposition is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn catch_up(c: &IntCounter, value: u64) {
    let have = c.get();
    if value > have {
        c.inc_by(value - have);
    }
}
