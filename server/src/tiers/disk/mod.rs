//! The local disk tier, below L1 (and above an L2, when both are configured): a cache larger
//! than DRAM at the drives' speed.
//!
//! - **What goes there**: what L1 evicts, not every store (DRAM first). Eviction is what it
//!   is without a disk tier; a victim's page goes to the write thread with it
//!   ([`crate::l1::cache::Demotion`]) while the store takes a page of the reserve kept for
//!   such writes (`--disk-write-queue-mb`). The thread writes each page straight from L1 (tiny
//!   pages are copied out), preparing the next while the previous are in flight, and frees it
//!   when done ([`writeout`]).
//! - **Where**: one circular log per drive, chunks dealt to the drives in turn
//!   ([`index`]); FIFO eviction on disk comes free with the log.
//! - **How**: io_uring with `O_DIRECT` ([`kvd_uring`]) on the pool registered as fixed
//!   buffers ([`fixed`]), a chunk split into `--disk-io-kb`
//!   pieces, `--disk-queue-depth` of them in flight per drive; one lookup's reads are issued
//!   together. No page cache where the filesystem allows it ([`drive`]).
//! - **Lookups**: one that L1 does not answer in full finds the rest of its prefix in the
//!   index, takes fresh L1 pages for it (`Filling`), has the read thread read, check and copy
//!   the values into them, and answers at once: the index's chunks count as hits and are
//!   pinned like L1's ([`fill`]). vLLM loads hits asynchronously, so the read overlaps the
//!   request's wait for its load; the retrieve waits for the fill, then is the usual DMA from
//!   L1. A disk slower than `--disk-deadline-ms`, or a value that fails its check, leaves the
//!   retrieve's chunks missing (vLLM recomputes them), never a stall.
//! - **Values** carry the L2 header ([`super::value`]): anything torn, foreign or damaged is
//!   rejected and counted before a byte reaches a page.
//! - **Restarts**: the index is journaled ([`journal`]); a clean restart keeps every chunk,
//!   a crash loses at most the writes in flight.
//! - **Faults**: a drive that fails I/O (or is full) is taken out of use and probed; kvd keeps
//!   serving from L1 and the other drives, and `/healthz` says which drive and why.

pub mod config;
pub mod drive;
pub mod fill;
pub mod fixed;
pub mod index;
pub mod io;
pub mod journal;
pub mod metrics;
pub mod writeout;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use futures_util::future::BoxFuture;
use parking_lot::Mutex;
use tokio::time::Instant;

use crate::l1::cache::Key;
use crate::l1::L1;
use crate::tiers::fill::{Fill, Registrations, Tier};
use crate::wire::Lookup;
use config::DiskConfig;
use drive::{Drive, DriveError};
use index::DiskIndex;
use journal::Journal;
use metrics::DiskMetrics;

/// How long an I/O error colours the tier's state as degraded.
const DEGRADED_WINDOW: Duration = Duration::from_secs(5);
/// How often failed drives are probed.
pub const PROBE_EVERY: Duration = Duration::from_secs(2);
/// The read rate assumed per drive until lookups' reads have measured one: a modest drive's.
const FIRST_READ_RATE: u64 = 1 << 30;

/// [`DiskTier::read_room`]'s share of the deadline, in thousandths: at most all of it, at least
/// a sixteenth.
const SHARE_MAX: u64 = 1000;
const SHARE_MIN: u64 = SHARE_MAX / 16;

/// The name a key has on disk; values carry a tag of it, so one found under another key's
/// place (a stale index after a crash) is foreign.
pub fn disk_name(key: &Key) -> String {
    format!(
        "kvd-disk:1:{:016x}:{:016x}:{}:{:032x}",
        key.fingerprint, key.salt, key.shard, key.hash
    )
}

/// What `/healthz` says about one drive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriveState {
    /// The file or device.
    pub path: String,
    /// `up`, `failed` or `full`.
    pub state: &'static str,
    /// Whether the page cache is bypassed.
    pub direct: bool,
    /// Bytes kvd uses of it.
    pub capacity_bytes: u64,
    /// Why it is not up.
    pub error: Option<String>,
}

/// What `/healthz` says about the disk tier.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskHealth {
    /// `up`, `degraded` (a drive is out, or I/O failed in the last seconds) or `down` (no
    /// drive is usable).
    pub state: &'static str,
    /// The last error since start.
    pub last_error: Option<String>,
    /// Seconds since `last_error` happened (it may be long over: `state` says whether the disk
    /// is degraded now).
    pub last_error_age_s: Option<f64>,
    /// Per drive.
    pub drives: Vec<DriveState>,
}

#[derive(Debug, Clone, Default)]
struct DriveHealth {
    failed: Option<String>,
    full: bool,
}

#[derive(Debug, Default)]
struct Health {
    drives: Vec<DriveHealth>,
    last_error: Option<String>,
    last_error_at: Option<Instant>,
}

/// The disk tier: drives, index, journal, worker threads, health and metrics.
#[derive(Debug)]
pub struct DiskTier {
    /// Settings.
    pub config: DiskConfig,
    /// Counters.
    pub metrics: DiskMetrics,
    /// The drives.
    pub drives: Vec<Drive>,
    /// Where chunks are.
    pub index: Mutex<DiskIndex>,
    journal: Mutex<Journal>,
    health: Mutex<Health>,
    stopping: AtomicBool,
    /// Bytes of lookups' reads queued or in flight.
    reading: AtomicU64,
    /// What the read thread reads, bytes per second: a moving mean over its jobs.
    read_rate: AtomicU64,
    /// The share of `--disk-deadline-ms`, in thousandths, that one lookup's reads may take at
    /// `read_rate` ([`DiskTier::read_room`]): halved by each retrieve that finds its chunks
    /// still being read at the deadline, and grown back by on-time reads.
    read_share: AtomicU64,
    threads: Mutex<Vec<JoinHandle<()>>>,
    reads: Mutex<Option<crossbeam_channel::Sender<io::ReadJob>>>,
    /// Told each time a read job's entries have settled.
    filled: tokio::sync::Notify,
    kick: (
        crossbeam_channel::Sender<()>,
        crossbeam_channel::Receiver<()>,
    ),
}

/// Why the disk tier could not start.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// A drive could not be opened.
    #[error(transparent)]
    Drive(#[from] DriveError),
    /// The index file holds something that is not a kvd index.
    #[error("--disk-index {path} holds data that is not a kvd index; kvd will not overwrite it. Name another file, or add --disk-overwrite {path} to let kvd replace it")]
    ForeignIndex {
        /// The file.
        path: String,
    },
    /// The index file is on a filesystem kvd sees read-only.
    #[error("--disk-index {path}: {source}; {}", drive::READ_ONLY_FIX)]
    ReadOnlyIndex {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The index file could not be read or written.
    #[error("--disk-index {path}: {source}; put it on a writable filesystem with room")]
    Index {
        /// The file.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

impl DiskTier {
    /// Opens the drives and the journal; call [`DiskTier::start`] to run it.
    pub fn open(config: DiskConfig, metrics: DiskMetrics) -> Result<Arc<DiskTier>, DiskError> {
        let drives = config
            .paths
            .iter()
            .map(|p| drive::open(p, config.bytes_per_path, config.direct, &config.overwrite))
            .collect::<Result<Vec<_>, _>>()?;
        let capacities: Vec<u64> = drives.iter().map(|d| d.capacity).collect();
        let mut index = DiskIndex::new(&capacities, kvd_uring::ALIGN as u64, drive::LABEL_BYTES);
        let described: Vec<(u64, &std::path::Path)> = drives
            .iter()
            .map(|d| (d.capacity, d.path.as_path()))
            .collect();
        let may_overwrite = config.overwrite.contains(&config.index);
        let (journal, replayed) =
            Journal::open(&config.index, &described, &mut index, may_overwrite).map_err(
                |source| {
                    let path = config.index.display().to_string();
                    if source.kind() == std::io::ErrorKind::AlreadyExists {
                        DiskError::ForeignIndex { path }
                    } else if source.raw_os_error() == Some(rustix::io::Errno::ROFS.raw_os_error())
                    {
                        DiskError::ReadOnlyIndex { path, source }
                    } else {
                        DiskError::Index { path, source }
                    }
                },
            )?;
        if let Some(why) = &replayed.discarded {
            tracing::warn!("{why}");
        }
        let mut health = Health::default();
        for (i, d) in drives.iter().enumerate() {
            let mut h = DriveHealth::default();
            if let Some(why) = &d.unusable {
                tracing::warn!("{why}; kvd serves without this drive");
                h.full = true;
                h.failed = Some(why.clone());
                health.last_error = Some(why.clone());
                health.last_error_at = Some(Instant::now());
                index.set_usable(i, false);
            }
            health.drives.push(h);
        }
        tracing::info!(
            "disk tier: {} ({} GiB, {} chunks kept from before, {} in flight per drive, {} KiB I/Os, deadline {} ms, index {})",
            drives
                .iter()
                .map(|d| format!("{}{}", d.path.display(), if d.direct { "" } else { " (page cache)" }))
                .collect::<Vec<_>>()
                .join(", "),
            capacities.iter().sum::<u64>() as f64 / (1u64 << 30) as f64,
            index.len(),
            config.queue_depth,
            config.io_bytes >> 10,
            config.deadline.as_millis(),
            config.index.display()
        );
        metrics.capacity_bytes.set(index.capacity_bytes() as i64);
        let drives_count = drives.len() as u64;
        let tier = DiskTier {
            config,
            metrics,
            drives,
            index: Mutex::new(index),
            journal: Mutex::new(journal),
            health: Mutex::new(health),
            stopping: AtomicBool::new(false),
            reading: AtomicU64::new(0),
            read_rate: AtomicU64::new(FIRST_READ_RATE * drives_count),
            read_share: AtomicU64::new(SHARE_MAX),
            threads: Mutex::new(Vec::new()),
            reads: Mutex::new(None),
            filled: tokio::sync::Notify::new(),
            kick: crossbeam_channel::bounded(1),
        };
        tier.refresh_gauges();
        tier.metrics
            .read_rate
            .set(tier.read_rate.load(Ordering::Relaxed) as i64);
        Ok(Arc::new(tier))
    }

    /// Starts the read and write threads and makes L1's eviction hand its victims over.
    pub fn start(
        self: &Arc<Self>,
        l1: Arc<L1>,
        regs: Arc<dyn Registrations>,
    ) -> std::io::Result<()> {
        let pool_bytes = l1.cache().stats().total_bytes;
        // Paced, the reserve keeps the drives' queues full at least and grows to a 64th of the
        // pool: on the H100 agentic replay (benches/results/2026-12-05-session-21.md) one
        // growing to an eighth (5-8% of L1 at the runs' end) cost L1 more hits than the disk
        // gave back, while 64 and 128 MiB (1-2% of L1) beat no disk in every round.
        let eighth = (pool_bytes / 8).max(1);
        let least = self.config.write_queue_bytes.min(eighth);
        let most = self
            .config
            .reserve_max_bytes
            .unwrap_or(pool_bytes / 64)
            .clamp(least, eighth);
        let kick = self.kick.0.clone();
        if self.config.paced {
            l1.cache().enable_paced_demotion(least, most, kick);
        } else {
            l1.cache().enable_demotion(least, kick);
        }
        let (tx, rx) = crossbeam_channel::bounded::<io::ReadJob>(64);
        *self.reads.lock() = Some(tx);
        let mut threads = self.threads.lock();
        let (tier, st) = (self.clone(), l1.clone());
        threads.push(
            std::thread::Builder::new()
                .name("kvd-disk-read".into())
                .spawn(move || io::read_loop(&tier, &st, rx))?,
        );
        let (tier, st, kick) = (self.clone(), l1, self.kick.1.clone());
        threads.push(
            std::thread::Builder::new()
                .name("kvd-disk-write".into())
                .spawn(move || writeout::write_loop(&tier, &st, &*regs, kick))?,
        );
        Ok(())
    }

    /// Bytes a new lookup may have read: what the drives read in a share of one
    /// `--disk-deadline-ms` (at the rate measured), at most `--disk-fetch-max-mb`, less the reads
    /// already queued. A fill past that would miss its deadline — its retrieve would find the
    /// chunks missing — while its pages sat pinned and empty; and queued behind it, every later
    /// lookup's would too.
    ///
    /// The share is paced to the drive: the whole deadline while reads keep to it, halved by each
    /// retrieve that did not get its chunks in time (a drive shared with the writes, a mean rate
    /// that a burst outran), and grown back by a sixteenth with each read job that took under
    /// half its share. A missed deadline costs the request its load and the time it waited; on
    /// the agentic replay on a 2-core VM they came 38-42 a run and cost more hits than the disk
    /// gave (benches/results/2026-12-04-session-13.md).
    pub(crate) fn read_room(&self) -> u64 {
        let rate = self.read_rate.load(Ordering::Relaxed) as f64;
        let share = self.read_share.load(Ordering::Relaxed) as f64 / SHARE_MAX as f64;
        let budget = ((rate * self.config.deadline.as_secs_f64() * share) as u64)
            .min(self.config.fetch_max_bytes);
        budget.saturating_sub(self.reading.load(Ordering::Relaxed))
    }

    /// A retrieve found its chunks still being read at the deadline: later lookups read less.
    fn missed_deadline(&self) {
        let share = self.read_share.load(Ordering::Relaxed);
        self.set_read_share((share / 2).max(SHARE_MIN));
    }

    fn set_read_share(&self, share: u64) {
        self.read_share.store(share, Ordering::Relaxed);
        self.metrics.read_share.set(share as f64 / SHARE_MAX as f64);
    }

    /// Whether no lookup's reads are queued or in flight.
    pub(crate) fn reads_idle(&self) -> bool {
        self.reading.load(Ordering::Relaxed) == 0
    }

    /// Counts `bytes` of reads as queued.
    pub(crate) fn reads_queued(&self, bytes: u64) {
        self.reading.fetch_add(bytes, Ordering::Relaxed);
    }

    /// Counts `bytes` of reads as done (or never sent), read in `took` when they were.
    pub(crate) fn reads_done(&self, bytes: u64, took: Option<Duration>) {
        self.reading.fetch_sub(bytes, Ordering::Relaxed);
        let Some(took) = took.filter(|t| !t.is_zero()) else {
            return;
        };
        let share = self.read_share.load(Ordering::Relaxed);
        // Under half the share it was given: the drive keeps up.
        let given = self.config.deadline.as_secs_f64() * (share as f64 / SHARE_MAX as f64);
        if share < SHARE_MAX && took.as_secs_f64() * 2.0 < given {
            self.set_read_share((share + SHARE_MAX / 16).min(SHARE_MAX));
        }
        let sample = (bytes as f64 / took.as_secs_f64()) as u64;
        let old = self.read_rate.load(Ordering::Relaxed);
        let rate = (old - old / 4 + sample / 4).max(1);
        self.read_rate.store(rate, Ordering::Relaxed);
        self.metrics.read_rate.set(rate as i64);
    }

    /// Sends a read job to the read thread; false when it has stopped or is backed up.
    pub(crate) fn submit_read(&self, job: io::ReadJob) -> Result<(), io::ReadJob> {
        match self.reads.lock().as_ref() {
            Some(tx) => tx.try_send(job).map_err(|e| e.into_inner()),
            None => Err(job),
        }
    }

    /// Waits until none of `keys` is being read back from disk any more, for at most
    /// `--disk-deadline-ms`: a retrieve's wait for the fills its lookup reported. Chunks still
    /// filling at the deadline are counted and left for the retrieve to find missing.
    pub async fn wait_for_fills(&self, l1: &L1, keys: &[Key]) {
        let until = Instant::now() + self.config.deadline;
        loop {
            let filled = self.filled.notified();
            tokio::pin!(filled);
            // Registered before the check, so that a job settling in between is not missed.
            filled.as_mut().enable();
            if !l1.cache().filling(keys) {
                return;
            }
            if tokio::time::timeout_at(until, filled).await.is_err() {
                self.metrics.load_timeouts.inc();
                self.missed_deadline();
                tracing::debug!(
                    "the disk did not fill a retrieve's chunks within --disk-deadline-ms {}; they are missing",
                    self.config.deadline.as_millis()
                );
                return;
            }
        }
    }

    /// Which of `keys` the drive holds, under one lock of the index.
    pub fn holds_keys<'a>(&self, keys: impl IntoIterator<Item = &'a Key>) -> Vec<bool> {
        let index = self.index.lock();
        keys.into_iter().map(|k| index.get(k).is_some()).collect()
    }

    /// Which of `hashes`, chunks of lookup `l`, the drive holds on every shard `l` names.
    pub fn holds_chunks(&self, l: &Lookup, hashes: &[u128]) -> Vec<bool> {
        let index = self.index.lock();
        hashes
            .iter()
            .map(|&hash| {
                l.shards.iter().all(|&shard| {
                    let key = Key {
                        fingerprint: l.fingerprint,
                        salt: l.salt,
                        shard,
                        hash,
                    };
                    index.get(&key).is_some()
                })
            })
            .collect()
    }

    /// Stops the threads (writes in flight complete) and saves the index for the next start.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.reads.lock().take();
        let _ = self.kick.0.try_send(());
        for t in self.threads.lock().drain(..) {
            if t.join().is_err() {
                tracing::error!("a disk-tier thread panicked");
            }
        }
        let mut journal = self.journal.lock();
        let index = self.index.lock();
        match journal.compact(&index) {
            Ok(()) => tracing::info!(
                "disk tier: index of {} chunks saved to {}",
                index.len(),
                self.config.index.display()
            ),
            Err(e) => tracing::error!(
                "disk tier: saving the index to {}: {e}; the next start finds the chunks journaled so far",
                self.config.index.display()
            ),
        }
    }

    /// Whether [`DiskTier::stop`] has begun.
    pub fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Records chunks just written: in the index, then in the journal. Returns the keys kept.
    pub(crate) fn commit(&self, written: &[(Key, index::Loc)]) -> Vec<Key> {
        let (kept, heads) = {
            let mut ix = self.index.lock();
            let kept: Vec<_> = written
                .iter()
                .copied()
                .filter(|(k, l)| ix.commit(*k, *l))
                .collect();
            (kept, ix.heads())
        };
        let mut j = self.journal.lock();
        if let Err(e) = j.append(&kept, &heads) {
            self.note_error("write", "io", &format!("appending to the disk index: {e}"));
        }
        if j.wants_compaction(&self.index.lock()) {
            let ix = self.index.lock();
            if let Err(e) = j.compact(&ix) {
                self.note_error("write", "io", &format!("compacting the disk index: {e}"));
            }
        }
        kept.into_iter().map(|(k, _)| k).collect()
    }

    /// Counts an error and remembers it for `/healthz`.
    pub(crate) fn note_error(&self, op: &str, kind: &str, why: &str) {
        self.metrics.errors.with_label_values(&[op, kind]).inc();
        let mut h = self.health.lock();
        h.last_error = Some(why.to_string());
        h.last_error_at = Some(Instant::now());
    }

    /// Takes a drive out of use after an I/O error (or because it is full).
    pub(crate) fn fail_drive(&self, drive: usize, op: &str, e: &std::io::Error) {
        let full = e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error());
        let path = self.drives[drive].path.display();
        let why = if full {
            format!("--disk {path}: no space left; free space there or lower --disk-size-gb")
        } else {
            format!("--disk {path}: {op} failed: {e}; check the drive (kvd serves without it)")
        };
        self.note_error(op, if full { "full" } else { "io" }, &why);
        let newly = {
            let mut h = self.health.lock();
            let d = &mut h.drives[drive];
            let newly = d.failed.is_none();
            d.failed = Some(why.clone());
            d.full = full;
            newly
        };
        self.index.lock().set_usable(drive, false);
        if newly {
            tracing::warn!("{why}");
        }
        self.refresh_gauges();
    }

    /// A failed drive answered its probe: back in use.
    pub(crate) fn revive_drive(&self, drive: usize) {
        self.health.lock().drives[drive].failed = None;
        self.index.lock().set_usable(drive, true);
        tracing::info!(
            "--disk {}: answers again; back in use",
            self.drives[drive].path.display()
        );
        self.refresh_gauges();
    }

    /// Drives that failed (not full) and should be probed.
    pub(crate) fn drives_to_probe(&self) -> Vec<usize> {
        let h = self.health.lock();
        (0..h.drives.len())
            .filter(|&i| h.drives[i].failed.is_some() && !h.drives[i].full)
            .collect()
    }

    /// Brings the gauges up to date.
    pub(crate) fn refresh_gauges(&self) {
        let ix = self.index.lock();
        let usable = (0..self.drives.len()).filter(|&d| ix.usable(d)).count();
        self.metrics.drives_usable.set(usable as i64);
        self.metrics.up.set(i64::from(usable > 0));
        self.metrics.used_bytes.set(ix.used_bytes() as i64);
        self.metrics.chunks.set(ix.len() as i64);
    }

    /// The health state now.
    pub fn health(&self) -> DiskHealth {
        let h = self.health.lock();
        let usable = h.drives.iter().filter(|d| d.failed.is_none()).count();
        let recent = h
            .last_error_at
            .is_some_and(|t| t.elapsed() < DEGRADED_WINDOW);
        DiskHealth {
            state: if usable == 0 {
                "down"
            } else if usable < h.drives.len() || recent {
                "degraded"
            } else {
                "up"
            },
            last_error: h.last_error.clone(),
            last_error_age_s: h
                .last_error_at
                .map(|t| (t.elapsed().as_secs_f64() * 10.0).round() / 10.0),
            drives: self
                .drives
                .iter()
                .zip(&h.drives)
                .map(|(d, dh)| DriveState {
                    path: d.path.display().to_string(),
                    state: match (&dh.failed, dh.full) {
                        (None, _) => "up",
                        (Some(_), true) => "full",
                        (Some(_), false) => "failed",
                    },
                    direct: d.direct,
                    capacity_bytes: d.capacity,
                    error: dh.failed.clone(),
                })
                .collect(),
        }
    }
}

impl Tier for DiskTier {
    /// The lookup does not wait: the reads are started and its chunks are `Filling`. (The
    /// disk is the chain's first tier: nothing is above it.)
    fn fill(
        self: Arc<Self>,
        l1: &Arc<L1>,
        regs: &Arc<dyn Registrations>,
        l: &Arc<Lookup>,
        _above: &[Arc<dyn Tier>],
    ) -> Fill {
        fill::start(l1, &**regs, &self, l);
        Fill::Now
    }

    fn holds(&self, l: &Lookup, hashes: &[u128]) -> Vec<bool> {
        self.holds_chunks(l, hashes)
    }

    fn answers_early(&self) -> bool {
        true
    }

    fn settle<'a>(&'a self, l1: &'a L1, keys: &'a [Key]) -> BoxFuture<'a, ()> {
        Box::pin(self.wait_for_fills(l1, keys))
    }
}

/// Opens the configured disk tier, if any.
pub fn open(
    config: Option<&DiskConfig>,
    metrics: &crate::ops::metrics::Metrics,
) -> Result<Option<Arc<DiskTier>>, DiskError> {
    match config {
        None => Ok(None),
        Some(c) => DiskTier::open(c.clone(), DiskMetrics::new(metrics)).map(Some),
    }
}
