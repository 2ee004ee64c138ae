//! Prometheus metrics, all prefixed `kvd_`. Counters that the cache keeps itself (evictions,
//! refusals, expired pins) are brought up to date at scrape time, so the hot path touches no
//! metric it does not own.
//!
//! Every label value a family can take is created at start ([`LABELS`]), so an idle kvd already
//! exports each documented series at 0 and dashboards and alerts find them before first use.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

use crate::l1::cache::CacheStats;

/// Every metric kvd exports.
#[derive(Debug, Clone)]
pub struct Metrics {
    registry: Registry,
    /// Pool size.
    pub pool_bytes: IntGauge,
    /// Pool bytes populated, pinned and handed to the allocator so far.
    pub pool_ready_bytes: IntGauge,
    /// Seconds from start until the whole pool was ready.
    pub pool_full_seconds: prometheus::Gauge,
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
    /// Stored chunks whose prefix is broken (a chunk before them is evicted), and their bytes.
    pub unreachable_chunks: IntGauge,
    /// Bytes of those chunks.
    pub unreachable_bytes: IntGauge,
    /// Store chunks refused, by reason.
    pub store_refusals: IntCounterVec,
    /// Lookup hit chunks reported unpinned because lookup pins held their share of the pool.
    pub pin_budget_chunks: IntCounter,
    /// Of those, chunks held until their retrieve, or not held (holds at their share).
    pub hold_chunks: IntCounterVec,
    /// Held chunks evicted because nothing else could be.
    pub holds_evicted: IntCounter,
    /// Chunks held now.
    pub held_chunks: IntGauge,
    /// L1 page bytes the disk tier is writing, and those it holds too (next to go).
    pub disk_writing_bytes: IntGauge,
    /// The reserve L1 keeps for those writes, paced to the drive.
    pub disk_reserve_bytes: IntGauge,
    /// Chunks lookups took back from the disk tier's writes.
    pub disk_taken_back: IntCounter,
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
    /// Copy jobs not started because their client's deadline had passed, by direction.
    pub copies_expired: IntCounterVec,
    /// Device resources whose release failed.
    pub gpu_release_errors: IntCounter,
    /// Copy jobs whose batch call the driver refused, copied run by run instead.
    pub copy_batch_fallbacks: IntCounter,
    /// Seconds from start until the first slabs were populated and pinned (kvd serving).
    pub pool_ready_seconds: prometheus::Gauge,
    /// 1 when /healthz would answer 200.
    pub ready: IntGauge,
    /// Copy throughput per job, by direction.
    pub copy_seconds: HistogramVec,
    /// CPU time spent submitting a job to its device, by direction.
    pub copy_submit_seconds: HistogramVec,
    /// Whether the pool is pinned for DMA.
    pub pool_pinned: IntGauge,
    /// Open ZMQ connections, including those still in their handshake.
    pub connections: IntGauge,
    /// ZMQ connections kvd closed or refused, by reason.
    pub connections_closed: IntCounterVec,
    /// fd-socket connections and messages refused, by reason.
    pub fd_socket_refusals: IntCounterVec,
    /// Open fd-socket connections.
    pub fd_socket_connections: IntGauge,
    /// Descriptors received and not yet claimed by a registration.
    pub fd_stashed: IntGauge,
    /// Removal records clients asked for after the feed had overwritten them.
    pub events_dropped: IntCounter,
}

/// The `code` values of `kvd_request_errors_total`: the wire's error codes as named on the wire.
const ERROR_CODES: &[&str] = &[
    "Malformed",
    "VersionMismatch",
    "HelloRequired",
    "UnknownRegion",
    "InvalidArgument",
    "NotReady",
    "ShuttingDown",
    "Device",
    "VmmMemory",
    "Busy",
    "FdMissing",
    "Internal",
];

/// Every label value of every labelled family, created at start.
pub const LABELS: &[(&str, &[&str])] = &[
    ("kvd_lookups_total", &["hit", "miss"]),
    ("kvd_lookup_chunks_total", &["hit", "miss"]),
    (
        "kvd_store_chunks_total",
        &["stored", "already_stored", "refused_pool_full", "skipped"],
    ),
    ("kvd_retrieve_chunks_total", &["loaded", "missing"]),
    ("kvd_store_refusals_total", &["pinned", "no_pages"]),
    (
        "kvd_request_duration_seconds",
        &[
            "hello",
            "register",
            "unregister",
            "lookup",
            "store",
            "retrieve",
            "release",
            "ping",
            "stats",
            "events",
        ],
    ),
    ("kvd_copy_duration_seconds", &["d2h", "h2d"]),
    ("kvd_copy_submit_duration_seconds", &["d2h", "h2d"]),
    (
        "kvd_malformed_frames_total",
        &[
            "too_large",
            "bad_magic",
            "version",
            "unknown_kind",
            "bad_length",
            "bad_field",
            "parts",
            "no_buffer",
        ],
    ),
    (
        "kvd_registration_refusals_total",
        &["vmm_memory", "invalid", "device", "fd_missing"],
    ),
    (
        "kvd_connections_closed_total",
        &[
            "full",
            "displaced_anonymous",
            "no_hello",
            "not_reading",
            "not_zmtp",
            "bad_handshake",
            "handshake_timeout",
        ],
    ),
    (
        "kvd_fd_socket_refusals_total",
        &["connections", "peer_connections", "idle", "stash_full"],
    ),
];

pub(crate) fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    registry
        .register(Box::new(c.clone()))
        .expect("unique metric");
    c
}

pub(crate) fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    registry
        .register(Box::new(g.clone()))
        .expect("unique metric");
    g
}

pub(crate) fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> IntCounterVec {
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
            "Time from submitting a copy job to its completion, by direction: the copy, plus any wait on the device for the client's event (a store waits for the forward pass that wrote its blocks) and for earlier jobs on the stream. Not the link's rate.",
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
            "Seconds from start until the pool's first slabs were populated and pinned and kvd served.",
        )
        .expect("valid metric");
        r.register(Box::new(pool_ready_seconds.clone()))
            .expect("unique metric");
        let pool_full_seconds = prometheus::Gauge::new(
            "kvd_pool_full_seconds",
            "Seconds from start until the whole pool was populated and pinned (0 while it grows).",
        )
        .expect("valid metric");
        r.register(Box::new(pool_full_seconds.clone()))
            .expect("unique metric");
        let m = Metrics {
            pool_bytes: gauge(&r, "kvd_pool_bytes", "L1 pool size in bytes."),
            pool_ready_bytes: gauge(&r, "kvd_pool_ready_bytes", "L1 pool bytes populated, pinned and in use by the allocator; grows to kvd_pool_bytes after start."),
            pool_full_seconds,
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
            unreachable_chunks: gauge(&r, "kvd_unreachable_chunks", "Stored chunks no lookup can reach: a chunk before them in their prefix is not held."),
            unreachable_bytes: gauge(&r, "kvd_unreachable_bytes", "Bytes of stored chunks no lookup can reach (kvd_unreachable_chunks)."),
            store_refusals: counter_vec(&r, "kvd_store_refusals_total", "Store chunks refused a page, by reason (pinned: every page pinned by lookups or copies; no_pages: no usable page of that size).", &["reason"]),
            pin_budget_chunks: counter(&r, "kvd_lookup_pin_budget_chunks_total", "Lookup hit chunks reported without a pin because lookup pins held their share of the pool (a store may evict them before the retrieve)."),
            hold_chunks: counter_vec(&r, "kvd_lookup_hold_chunks_total", "Lookup hit chunks reported without a pin, by outcome (held: evicted only when nothing else can be, until their retrieve or --lookup-hold-ms; over_budget: not held, holds covered --lookup-hold-pct of the pool).", &["outcome"]),
            holds_evicted: counter(&r, "kvd_lookup_holds_evicted_total", "Held chunks (reported by a lookup, not yet retrieved) evicted because nothing else in the pool could be."),
            held_chunks: gauge(&r, "kvd_lookup_held_chunks", "Chunks held for a lookup's retrieve."),
            disk_writing_bytes: gauge(&r, "kvd_l1_disk_writing_bytes", "L1 page bytes of evicted chunks the disk tier is writing (pages back to free when done; they and free pages make the reserve, kvd_l1_disk_reserve_bytes)."),
            disk_taken_back: counter(&r, "kvd_l1_disk_taken_back_total", "Evicted chunks a lookup asked for while the disk tier was still writing them: taken back into L1 from the same page (a hit), and written all the same."),
            disk_reserve_bytes: gauge(&r, "kvd_l1_disk_reserve_bytes", "L1 pool bytes kept for the disk tier's writes (L1 holds chunks in the rest): grows to hold a burst of evictions the drive then caught up with, shrinks while the drive stays behind; fixed by --disk-write-queue-mb."),
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
            copies_expired: counter_vec(&r, "kvd_copies_expired_total", "Stores (d2h) and retrieves (h2d) not copied because the client's deadline had passed before kvd could start them: the client may have reused those blocks.", &["direction"]),
            gpu_release_errors: counter(&r, "kvd_gpu_release_errors_total", "Device resources (imports, events, registrations) whose release failed."),
            copy_batch_fallbacks: counter(&r, "kvd_copy_batch_fallbacks_total", "Copy jobs the driver's batch copy refused, copied run by run instead."),
            pool_ready_seconds,
            ready: gauge(&r, "kvd_ready", "1 when the pool is ready and the server loop answers."),
            copy_seconds,
            copy_submit_seconds,
            pool_pinned: gauge(&r, "kvd_pool_pinned", "1 when the pool is registered with a GPU driver for DMA."),
            connections: gauge(&r, "kvd_connections", "Open ZMQ connections, including those not yet identified by a hello."),
            connections_closed: counter_vec(&r, "kvd_connections_closed_total", "ZMQ connections kvd refused or closed, by reason (full, displaced_anonymous, no_hello, not_reading; before a handshake: not_zmtp, bad_handshake, handshake_timeout).", &["reason"]),
            fd_socket_refusals: counter_vec(&r, "kvd_fd_socket_refusals_total", "fd-socket connections or messages refused, by reason (connections, peer_connections, idle, stash_full).", &["reason"]),
            fd_socket_connections: gauge(&r, "kvd_fd_socket_connections", "Open fd-socket connections."),
            fd_stashed: gauge(&r, "kvd_fd_stashed", "Descriptors received on the fd socket and not yet claimed by a registration."),
            events_dropped: counter(&r, "kvd_events_dropped_total", "Removal records (evicted chunks) that Events requests asked for after the feed's ring had overwritten them (--events-capacity)."),
            registry: r,
        };
        m.init_labels();
        crate::ops::process_metrics::register(&m.registry);
        m
    }

    /// Creates every series of [`LABELS`] at zero.
    fn init_labels(&self) {
        for (family, values) in LABELS {
            for v in *values {
                match *family {
                    "kvd_lookups_total" => drop(self.lookups.with_label_values(&[v])),
                    "kvd_lookup_chunks_total" => drop(self.lookup_chunks.with_label_values(&[v])),
                    "kvd_store_chunks_total" => drop(self.store_chunks.with_label_values(&[v])),
                    "kvd_store_refusals_total" => drop(self.store_refusals.with_label_values(&[v])),
                    "kvd_retrieve_chunks_total" => {
                        drop(self.retrieve_chunks.with_label_values(&[v]))
                    }
                    "kvd_request_duration_seconds" => drop(self.request_timer(v)),
                    "kvd_copy_duration_seconds" => drop(self.copy_seconds.with_label_values(&[v])),
                    "kvd_copy_submit_duration_seconds" => {
                        drop(self.copy_submit_seconds.with_label_values(&[v]))
                    }
                    "kvd_malformed_frames_total" => {
                        drop(self.malformed_frames.with_label_values(&[v]))
                    }
                    "kvd_registration_refusals_total" => {
                        drop(self.registration_refusals.with_label_values(&[v]))
                    }
                    "kvd_connections_closed_total" => {
                        drop(self.connections_closed.with_label_values(&[v]))
                    }
                    "kvd_fd_socket_refusals_total" => {
                        drop(self.fd_socket_refusals.with_label_values(&[v]))
                    }
                    other => unreachable!("LABELS names {other}, which has no field here"),
                }
            }
        }
        // Error replies by op and code: every pair, so an alert on one finds a series at 0.
        let ops = LABELS
            .iter()
            .find(|(f, _)| *f == "kvd_request_duration_seconds")
            .map_or(&[][..], |(_, v)| *v);
        for op in ops {
            for code in ERROR_CODES {
                drop(self.request_errors.with_label_values(&[op, code]));
            }
        }
    }

    /// Brings pool gauges and cache-owned counters up to date.
    pub fn observe_cache(&self, s: &CacheStats) {
        self.pool_used_bytes.set(s.usage.used_bytes as i64);
        self.pool_ready_bytes.set(s.capacity_bytes as i64);
        self.pinned_pages.set(s.pinned_pages as i64);
        self.chunks.set(s.entries as i64);
        self.lookup_pins.set(s.pin_sets as i64);
        catch_up(&self.evictions, s.counters.evictions);
        catch_up(&self.pins_expired, s.counters.pins_expired);
        self.unreachable_chunks.set(s.unreachable_chunks as i64);
        self.unreachable_bytes.set(s.unreachable_bytes as i64);
        catch_up(
            &self.store_refusals.with_label_values(&["pinned"]),
            s.counters.refused_pinned,
        );
        catch_up(
            &self.store_refusals.with_label_values(&["no_pages"]),
            s.counters.refused_no_pages,
        );
        catch_up(&self.pin_budget_chunks, s.counters.pin_budget_chunks);
        catch_up(
            &self.hold_chunks.with_label_values(&["held"]),
            s.counters.hold_chunks,
        );
        catch_up(
            &self.hold_chunks.with_label_values(&["over_budget"]),
            s.counters.hold_budget_chunks,
        );
        catch_up(&self.holds_evicted, s.counters.holds_evicted);
        self.held_chunks.set(s.held_chunks as i64);
        self.disk_writing_bytes.set(s.disk_writing_bytes as i64);
        self.disk_reserve_bytes.set(s.disk_reserve_bytes as i64);
        catch_up(&self.disk_taken_back, s.disk_taken_back);
        catch_up(&self.gpu_release_errors, kvd_gpu::release_errors());
        catch_up(&self.copy_batch_fallbacks, kvd_gpu::cuda::batch_fallbacks());
    }

    /// The registry, for metrics registered elsewhere (the L2 tier's).
    pub(crate) fn registry(&self) -> &Registry {
        &self.registry
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_label_is_exported_before_first_use() {
        let text = Metrics::new().render();
        for (family, values) in LABELS {
            for v in *values {
                let series = text
                    .lines()
                    .filter(|l| l.starts_with(family) && l.contains(&format!("=\"{v}\"")))
                    .count();
                assert!(series > 0, "{family} has no {v:?} series:\n{text}");
            }
        }
    }
}
