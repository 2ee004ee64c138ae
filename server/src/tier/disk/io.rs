//! The disk tier's two threads, each with its own ring so that reads for lookups never queue
//! behind write-out: `kvd-disk-read` runs one lookup's reads at a time (all of them in flight
//! together), checks every value and copies it into its L1 page; `kvd-disk-write` takes the
//! chunks L1 evicted, copies them out of their pages (which are then free), and writes them.
//!
//! A chunk is read and written in `--disk-io-kb` pieces, up to `--disk-queue-depth` in flight
//! per drive. Buffers are aligned anonymous mappings, reused between batches.

use std::os::fd::AsFd;
use std::time::Duration;

use kvd_uring::{AlignedBuf, Buf, Op, Ring, ALIGN};
use tokio::time::Instant;

use super::index::{Alloc, Loc};
use super::{disk_name, DiskTier, PROBE_EVERY};
use crate::cache::{Demotion, Key};
use crate::evict::EntryId;
use crate::state::State;
use crate::tier::value;

/// Bytes of buffers a thread keeps for reuse.
const KEEP_BUFFER_BYTES: usize = 512 << 20;

/// One value to read into one L1 page.
#[derive(Debug, Clone, Copy)]
pub struct ReadItem {
    /// Which chunk of the lookup's wanted chunks it belongs to.
    pub chunk: usize,
    /// Its key.
    pub key: Key,
    /// Where it is on disk.
    pub loc: Loc,
    /// Its byte offset in the drive's file.
    pub offset: u64,
    /// Bytes to read (whole blocks).
    pub len: u64,
    /// The `Writing` L1 entry it fills.
    pub entry: EntryId,
    /// That entry's page offset in the pool.
    pub page_offset: u64,
    /// The page's size.
    pub page_bytes: u64,
    /// The region's layout digest.
    pub digest: u64,
}

/// One lookup's reads.
#[derive(Debug)]
pub struct ReadJob {
    /// The values, by chunk then shard.
    pub items: Vec<ReadItem>,
    /// Chunks the items cover.
    pub chunks: usize,
    /// Gets the outcome (the lookup may have stopped waiting).
    pub reply: tokio::sync::oneshot::Sender<ReadDone>,
}

/// What a read job did.
#[derive(Debug, Default, Clone, Copy)]
pub struct ReadDone {
    /// Chunks now hits in L1, from the first.
    pub hit_chunks: usize,
    /// Bytes put into pages.
    pub bytes: u64,
}

/// Reusable aligned buffers.
#[derive(Debug, Default)]
struct Buffers {
    free: Vec<AlignedBuf>,
    kept: usize,
}

impl Buffers {
    fn take(&mut self, len: usize) -> std::io::Result<AlignedBuf> {
        let fits = |b: &AlignedBuf| b.capacity() >= len && b.capacity() <= 2 * len.max(ALIGN);
        match self.free.iter().position(fits) {
            Some(i) => {
                let b = self.free.swap_remove(i);
                self.kept -= b.capacity();
                Ok(b)
            }
            None => AlignedBuf::new(len),
        }
    }

    fn give(&mut self, b: AlignedBuf) {
        if self.kept + b.capacity() <= KEEP_BUFFER_BYTES {
            self.kept += b.capacity();
            self.free.push(b);
        }
    }
}

fn ring_for(tier: &DiskTier) -> Option<Ring> {
    let entries = (tier.config.queue_depth * tier.drives.len()) as u32;
    match Ring::new(entries) {
        Ok(r) => Some(r),
        Err(e) => {
            let why = format!(
                "io_uring could not be set up ({e}); the disk tier is off — allow io_uring \
                 (kernel.io_uring_disabled=0, or the container's seccomp profile)"
            );
            tracing::error!("{why}");
            tier.note_error("setup", "io", &why);
            for d in 0..tier.drives.len() {
                tier.index.lock().set_usable(d, false);
            }
            tier.refresh_gauges();
            None
        }
    }
}

/// Ops for reading or writing each buffer's first `len` bytes in `io_bytes` pieces; returns
/// them with the buffer each belongs to.
fn pieces<'a>(
    tier: &'a DiskTier,
    places: &[(usize, u64, u64)],
    bufs: &'a mut [AlignedBuf],
    write: bool,
) -> (Vec<Op<'a>>, Vec<usize>) {
    let io = tier.config.io_bytes;
    let mut ops = Vec::new();
    let mut owner = Vec::new();
    for (i, (buf, &(drive, offset, len))) in bufs.iter_mut().zip(places).enumerate() {
        let fd = tier.drives[drive].file.as_fd();
        let bytes = &mut buf.as_mut_slice()[..len as usize];
        if write {
            for (p, piece) in bytes.chunks(io).enumerate() {
                ops.push(Op {
                    fd,
                    offset: offset + (p * io) as u64,
                    buf: Buf::Write(piece),
                    lane: drive,
                });
                owner.push(i);
            }
        } else {
            for (p, piece) in bytes.chunks_mut(io).enumerate() {
                ops.push(Op {
                    fd,
                    offset: offset + (p * io) as u64,
                    buf: Buf::Read(piece),
                    lane: drive,
                });
                owner.push(i);
            }
        }
    }
    (ops, owner)
}

/// Runs the ops and gives each buffer's first error, if any.
fn run(
    ring: &mut Ring,
    depth: usize,
    mut ops: Vec<Op<'_>>,
    owner: &[usize],
    n: usize,
) -> Vec<Option<std::io::Error>> {
    let results = ring.run(&mut ops, depth);
    let mut first: Vec<Option<std::io::Error>> = (0..n).map(|_| None).collect();
    for (r, &i) in results.into_iter().zip(owner) {
        if let (Err(e), None) = (r, &first[i]) {
            first[i] = Some(e);
        }
    }
    first
}

/// The read thread: one job at a time until the channel closes.
pub fn read_loop(tier: &DiskTier, state: &State, jobs: crossbeam_channel::Receiver<ReadJob>) {
    let Some(mut ring) = ring_for(tier) else {
        return;
    };
    let mut bufs = Buffers::default();
    while let Ok(job) = jobs.recv() {
        if !tier.config.inject_delay.is_zero() {
            std::thread::sleep(tier.config.inject_delay);
        }
        let done = read_job(tier, state, &mut ring, &mut bufs, &job.items, job.chunks);
        let _ = job.reply.send(done);
    }
}

fn read_job(
    tier: &DiskTier,
    state: &State,
    ring: &mut Ring,
    bufs: &mut Buffers,
    items: &[ReadItem],
    chunks: usize,
) -> ReadDone {
    let m = &tier.metrics;
    let mut ok = vec![false; items.len()];
    let mut buffers = Vec::with_capacity(items.len());
    let mut places = Vec::with_capacity(items.len());
    for it in items {
        match bufs.take(it.len as usize) {
            Ok(b) => {
                buffers.push(b);
                places.push((it.loc.drive as usize, it.offset, it.len));
            }
            Err(e) => {
                tracing::warn!("disk tier: no memory for a read buffer: {e}");
                break;
            }
        }
    }
    let n = buffers.len();
    let (ops, owner) = pieces(tier, &places, &mut buffers, false);
    let errors = run(ring, tier.config.queue_depth, ops, &owner, n);
    let pool = state.devices.get().map(|d| d.pool().clone());
    let mut bytes = 0u64;
    for (i, (it, err)) in items.iter().zip(errors).enumerate() {
        let reason = match err {
            Some(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Some("truncated"),
            Some(e) => {
                tier.fail_drive(it.loc.drive as usize, "read", &e);
                None
            }
            None => {
                let v = &buffers[i].as_slice()[..it.loc.value_bytes as usize];
                // The disk is this node's own: checksummed values, no MAC (see tier/value.rs).
                match value::Codec::default().open(v, it.digest, &disk_name(&it.key), it.page_bytes)
                {
                    Err(why) => Some(why.label()),
                    Ok(payload) => {
                        match pool.as_ref().map(|p| p.write(it.page_offset, payload)) {
                            Some(Ok(())) => {
                                ok[i] = true;
                                bytes += payload.len() as u64;
                            }
                            Some(Err(e)) => {
                                tracing::warn!("writing a disk value into the pool: {e}")
                            }
                            None => {}
                        }
                        None
                    }
                }
            }
        };
        if let Some(reason) = reason {
            m.rejected.with_label_values(&[reason]).inc();
            tier.index.lock().remove(&it.key);
            tracing::warn!(
                "rejected a value on --disk {} at byte {} ({reason}); it was not used",
                tier.drives[it.loc.drive as usize].path.display(),
                it.offset
            );
        }
    }
    for b in buffers {
        bufs.give(b);
    }
    // A hit is a prefix: from the first chunk with a bad shard on, nothing is kept.
    let bad_from = items
        .iter()
        .zip(&ok)
        .filter(|(_, ok)| !**ok)
        .map(|(it, _)| it.chunk)
        .min()
        .unwrap_or(chunks);
    let (good, bad): (Vec<_>, Vec<_>) = items
        .iter()
        .zip(&ok)
        .partition(|(it, ok)| **ok && it.chunk < bad_from);
    let good: Vec<EntryId> = good.into_iter().map(|(it, _)| it.entry).collect();
    let bad: Vec<EntryId> = bad.into_iter().map(|(it, _)| it.entry).collect();
    {
        let mut cache = state.cache.lock();
        cache.finish_store(&good, true);
        cache.finish_store(&bad, false);
    }
    m.fill_chunks
        .with_label_values(&["filled"])
        .inc_by(good.len() as u64);
    m.bytes.with_label_values(&["read"]).inc_by(bytes);
    tier.refresh_gauges();
    ReadDone {
        hit_chunks: bad_from,
        bytes,
    }
}

/// The write thread: writes what L1 evicts until the tier stops; probes failed drives.
pub fn write_loop(tier: &DiskTier, state: &State, kick: crossbeam_channel::Receiver<()>) {
    let ring = ring_for(tier);
    let mut bufs = Buffers::default();
    let mut last_probe = Instant::now();
    let mut ring = ring;
    let mut skipped = 0;
    loop {
        let _ = kick.recv_timeout(Duration::from_millis(100));
        let (pending, now_skipped) = {
            let mut cache = state.cache.lock();
            (cache.take_demotions(), cache.demotions_skipped())
        };
        tier.metrics
            .evicted
            .with_label_values(&["dropped_busy"])
            .inc_by(now_skipped - skipped);
        skipped = now_skipped;
        let Some(ring) = ring.as_mut().filter(|_| !tier.stopping()) else {
            // Stopping, or no ring: the pages go back to L1 unwritten.
            let ids: Vec<EntryId> = pending.iter().map(|d| d.entry).collect();
            state.cache.lock().finish_demotions(&ids);
            if tier.stopping() {
                return;
            }
            continue;
        };
        // All of them at once: their pages (at most --disk-write-queue-mb) are copied out and
        // freed before the first write, so stores never wait behind the disk for pages.
        if !pending.is_empty() {
            write_batch(tier, state, ring, &mut bufs, pending);
        }
        if last_probe.elapsed() >= PROBE_EVERY {
            last_probe = Instant::now();
            probe(tier, ring, &mut bufs);
        }
    }
}

fn write_batch(
    tier: &DiskTier,
    state: &State,
    ring: &mut Ring,
    bufs: &mut Buffers,
    batch: Vec<Demotion>,
) {
    let m = &tier.metrics;
    let digests: Vec<Option<u64>> = {
        let sessions = state.sessions.lock();
        batch
            .iter()
            .map(|d| Some(sessions.placement(d.key.fingerprint, d.key.shard)?.1))
            .collect()
    };
    let pool = state.devices.get().map(|d| d.pool().clone());
    let mut items: Vec<(Key, Alloc)> = Vec::new();
    let mut buffers = Vec::new();
    for (d, digest) in batch.iter().zip(digests) {
        if tier.index.lock().get(&d.key).is_some() {
            m.evicted.with_label_values(&["present"]).inc();
            continue;
        }
        let (Some(digest), Some(pool)) = (digest, pool.as_ref()) else {
            m.evicted.with_label_values(&["dropped_unregistered"]).inc();
            continue;
        };
        let value_bytes = value::HEADER_V1_BYTES as u64 + d.page_bytes;
        let Some(alloc) = tier.index.lock().allocate(value_bytes) else {
            m.evicted.with_label_values(&["failed"]).inc();
            continue;
        };
        let mut buf = match bufs.take(alloc.len as usize) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("disk tier: no memory for a write buffer: {e}");
                m.evicted.with_label_values(&["failed"]).inc();
                continue;
            }
        };
        let v = &mut buf.as_mut_slice()[..value_bytes as usize];
        if let Err(e) = pool.read(d.offset, &mut v[value::HEADER_V1_BYTES..]) {
            tracing::warn!("reading an evicted chunk for the disk: {e}");
            m.evicted.with_label_values(&["failed"]).inc();
            bufs.give(buf);
            continue;
        }
        value::Codec::default().seal(v, digest, &disk_name(&d.key));
        items.push((d.key, alloc));
        buffers.push(buf);
    }
    // Copied out: the pages are L1's again before the disk is even asked.
    let ids: Vec<EntryId> = batch.iter().map(|d| d.entry).collect();
    state.cache.lock().finish_demotions(&ids);
    m.released.inc_by(ids.len() as u64);
    if items.is_empty() {
        return;
    }
    let places: Vec<(usize, u64, u64)> = items
        .iter()
        .map(|(_, a)| (a.loc.drive as usize, a.offset, a.len))
        .collect();
    let n = buffers.len();
    let (ops, owner) = pieces(tier, &places, &mut buffers, true);
    let errors = run(ring, tier.config.queue_depth, ops, &owner, n);
    let mut written = Vec::new();
    let mut bytes = 0;
    for ((key, alloc), err) in items.iter().zip(errors) {
        match err {
            None => {
                written.push((*key, alloc.loc));
                bytes += alloc.loc.value_bytes - value::HEADER_V1_BYTES as u64;
            }
            Some(e) => {
                tier.fail_drive(alloc.loc.drive as usize, "write", &e);
                m.evicted.with_label_values(&["failed"]).inc();
            }
        }
    }
    for b in buffers {
        bufs.give(b);
    }
    let kept = tier.commit(&written);
    m.evicted
        .with_label_values(&["written"])
        .inc_by(kept as u64);
    m.evicted
        .with_label_values(&["failed"])
        .inc_by((written.len() - kept) as u64);
    m.bytes.with_label_values(&["write"]).inc_by(bytes);
    tier.refresh_gauges();
}

/// Reads the first block of each failed drive; one that answers is used again.
fn probe(tier: &DiskTier, ring: &mut Ring, bufs: &mut Buffers) {
    for drive in tier.drives_to_probe() {
        let Ok(mut buf) = bufs.take(ALIGN) else {
            return;
        };
        let (ops, owner) = pieces(
            tier,
            &[(drive, 0, ALIGN as u64)],
            std::slice::from_mut(&mut buf),
            false,
        );
        match run(ring, 1, ops, &owner, 1).pop().flatten() {
            None => tier.revive_drive(drive),
            Some(e) => tier.note_error(
                "probe",
                "io",
                &format!(
                    "--disk {}: still failing: {e}; check the drive",
                    tier.drives[drive].path.display()
                ),
            ),
        }
        bufs.give(buf);
    }
}
