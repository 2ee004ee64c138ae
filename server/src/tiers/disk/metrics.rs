//! The disk tier's metrics, prefixed `kvd_disk_`, in kvd's one registry.

use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
};

use crate::ops::metrics::{counter, counter_vec, gauge, Metrics};

/// Every disk-tier metric.
#[derive(Debug, Clone)]
pub struct DiskMetrics {
    /// 1 while at least one drive is usable.
    pub up: IntGauge,
    /// Drives in use.
    pub drives_usable: IntGauge,
    /// Bytes of the drives.
    pub capacity_bytes: IntGauge,
    /// Bytes the indexed chunks take.
    pub used_bytes: IntGauge,
    /// Chunks indexed.
    pub chunks: IntGauge,
    /// Chunks lookups asked the disk for (after missing L1), by result (hit: read back intact,
    /// miss), counted when the reads are done.
    pub lookup_chunks: IntCounterVec,
    /// Retrieves that gave up waiting for disk reads at the deadline.
    pub load_timeouts: IntCounter,
    /// Bytes moved, by direction (read, write).
    pub bytes: IntCounterVec,
    /// Chunks evicted from L1, by what became of them (written, present, dropped_busy,
    /// not_admitted, dropped_unregistered, failed).
    pub evicted: IntCounterVec,
    /// Evicted chunks whose L1 pages the disk tier has released (copied out, or not needed).
    pub released: IntCounter,
    /// Values rejected, by reason (truncated, version, foreign, length, corrupt).
    pub rejected: IntCounterVec,
    /// I/O errors, by op (read, write, probe) and kind (io, full).
    pub errors: IntCounterVec,
    /// Disk hits for L1, by outcome (filled, present, no_free_page, busy, client_holds).
    pub fill_chunks: IntCounterVec,
    /// Read rate of lookups' reads, bytes per second (moving mean).
    pub read_rate: IntGauge,
    /// The share of `--disk-deadline-ms` one lookup's reads may take (paced to the drive).
    pub read_share: Gauge,
    /// Values read straight into their L1 page (no bounce buffer).
    pub direct_reads: IntCounter,
    /// Time from a lookup's disk reads to its hits being in L1.
    pub fetch_seconds: Histogram,
    /// I/Os submitted, by direction (read, write) and buffer (fixed: a registered piece of the
    /// pool; plain: anything else).
    pub ios: IntCounterVec,
    /// Bytes of the pool registered as io_uring fixed buffers, by ring (read, write).
    pub fixed_bytes: IntGaugeVec,
}

impl DiskMetrics {
    /// Registers the disk metrics beside kvd's others.
    pub fn new(m: &Metrics) -> DiskMetrics {
        let r = m.registry();
        let read_share = Gauge::new(
            "kvd_disk_read_deadline_share",
            "The share of --disk-deadline-ms that one lookup's disk reads may take at the read rate: 1 while reads keep to the deadline, halved by each retrieve that finds its chunks still being read at it.",
        )
        .expect("valid metric");
        r.register(Box::new(read_share.clone()))
            .expect("unique metric");
        read_share.set(1.0);
        let fetch = Histogram::with_opts(
            HistogramOpts::new(
                "kvd_disk_fetch_duration_seconds",
                "Time from a lookup's disk reads until its hits are in L1 pages.",
            )
            .buckets(prometheus::exponential_buckets(1e-4, 2.0, 16).expect("buckets")),
        )
        .expect("valid metric");
        r.register(Box::new(fetch.clone())).expect("unique metric");
        let fixed_bytes = IntGaugeVec::new(
            Opts::new(
                "kvd_disk_fixed_buffer_bytes",
                "Bytes of the L1 pool registered with a disk-tier io_uring ring as fixed buffers, by ring (read, write).",
            ),
            &["ring"],
        )
        .expect("valid metric");
        r.register(Box::new(fixed_bytes.clone()))
            .expect("unique metric");
        DiskMetrics {
            up: gauge(r, "kvd_disk_up", "1 while at least one drive of the disk tier is usable."),
            drives_usable: gauge(r, "kvd_disk_drives_usable", "Drives of the disk tier in use (not failed or full)."),
            capacity_bytes: gauge(r, "kvd_disk_capacity_bytes", "Bytes of the disk tier's drives."),
            used_bytes: gauge(r, "kvd_disk_used_bytes", "Bytes the disk tier's indexed chunks take."),
            chunks: gauge(r, "kvd_disk_chunks", "Chunks the disk tier holds."),
            lookup_chunks: counter_vec(r, "kvd_disk_lookup_chunks_total", "Chunks lookups asked the disk for (after missing L1), by result (hit, miss).", &["result"]),
            load_timeouts: counter(r, "kvd_disk_load_timeouts_total", "Retrieves that found chunks still being read from disk at --disk-deadline-ms and answered them missing."),
            bytes: counter_vec(r, "kvd_disk_bytes_total", "Chunk bytes moved to and from the disk tier, by direction (read, write).", &["direction"]),
            evicted: counter_vec(r, "kvd_disk_evicted_chunks_total", "Chunks L1 evicted with a disk tier, by what became of them: written, present (on disk already), dropped_busy (not written: the writes held all of --disk-write-queue-mb), not_admitted (not written: eviction expects no read of it), dropped_unregistered, failed.", &["outcome"]),
            released: counter(r, "kvd_disk_released_chunks_total", "Evicted chunks whose L1 pages the disk tier has released (copied out for writing, or not needed)."),
            rejected: counter_vec(r, "kvd_disk_rejected_values_total", "Disk values refused before reaching L1, by reason (truncated, version, foreign, length, corrupt).", &["reason"]),
            errors: counter_vec(r, "kvd_disk_errors_total", "Disk I/O errors, by op (read, write, probe) and kind (io, full).", &["op", "kind"]),
            fill_chunks: counter_vec(r, "kvd_disk_fill_chunks_total", "Disk hits for L1, by outcome (filled; present: L1 had it; no_free_page: every L1 page was pinned; busy: reads queued already fill --disk-deadline-ms; client_holds: not read, the lookup's client holds it already).", &["outcome"]),
            read_rate: gauge(r, "kvd_disk_read_bytes_per_second", "What the disk tier reads for lookups, bytes per second (a moving mean over lookups' reads): with --disk-deadline-ms, it sets how much one lookup may read."),
            read_share,
            direct_reads: counter(r, "kvd_disk_direct_reads_total", "Disk values read straight into their L1 page by the drive (pages of whole 4 KiB blocks), not through a bounce buffer."),
            fetch_seconds: fetch,
            ios: counter_vec(r, "kvd_disk_ios_total", "Disk-tier I/Os submitted, by direction (read, write) and buffer (fixed: ReadFixed/WriteFixed on a registered piece of the pool; plain: headers, bounce buffers, or a pool not registered).", &["direction", "buffer"]),
            fixed_bytes,
        }
    }
}
