//! `kvd-disk-write`: writes what L1 evicts ([`crate::l1::cache`]'s `demote`), and probes
//! failed drives.
//!
//! A chunk whose page is whole 4 KiB blocks is written straight from its L1 page: the thread
//! hashes the page in place, seals a header block, and pushes the header and the page's
//! `--disk-io-kb` pieces into a [`WriteQueue`], which keeps up to `--disk-queue-depth` of them
//! in flight per drive; the page (its chunk already out of L1's index) stays unchanged until
//! they complete, and is then free. Other chunks (tiny pages) are copied into an aligned buffer
//! with their header, and their page is given back at once. The
//! next chunk is prepared while the previous ones are on their way, and
//! chunks are recorded in the index as their last piece completes. The pool is registered with
//! the queue's ring as fixed buffers ([`super::fixed`]), so a page's writes are `WriteFixed`.
//!
//! Why: copying a whole batch out of L1 and then writing it, in turn, left the drive idle for
//! every copy — 0.76–0.79 of fio's write rate (benches/RESULTS.md, issue 21); an strace of the
//! pipelined copy on the shared 2-core dev VM showed 32 MiB copied and sealed in ~60 ms while
//! the drive wrote it in ~16 ms, so the copy itself had to go. Buffers and pages held for
//! writes in flight are bounded by `--disk-write-queue-mb` (an eighth of the pool at most).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use kvd_uring::{AlignedBuf, Completion, Ring, Source, WriteQueue, ALIGN};
use tokio::time::Instant;

use super::fixed::FixedPool;
use super::index::Alloc;
use super::io::{
    apart, in_parallel, pieces, ring_for, run, value_bytes, Buffers, CHECK_SPLIT_BYTES,
};
use super::{disk_name, DiskTier, PROBE_EVERY};
use crate::l1::cache::{Demotion, Key};
use crate::l1::evict::EntryId;
use crate::l1::L1;
use crate::tiers::fill::Registrations;
use crate::tiers::value;

/// Pages hashed ahead at most at once (each on its own thread when large: [`in_parallel`]).
const HASH_AHEAD: usize = 8;

/// Page bytes released together (a lock of the cache per release batch, not per tiny chunk).
const RELEASE_EVERY_BYTES: u64 = 8 << 20;

/// What became of a chunk handed to the write thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Queued {
    /// Its writes read its page in place: the page is released when they complete.
    InPlace,
    /// Copied into a buffer with its header (a page that is not whole blocks): the page may go.
    Copied,
    /// The disk holds it already.
    Present,
    /// Not written (counted why).
    Not,
}

/// A chunk whose pieces are being written.
#[derive(Debug)]
struct Writing {
    key: Key,
    alloc: Alloc,
    page_bytes: u64,
    buf: Arc<AlignedBuf>,
    left: usize,
    error: Option<std::io::Error>,
    /// The L1 page its writes read in place, released when they are done.
    page: Option<EntryId>,
}

/// The write thread's state between iterations.
struct Writer<'t> {
    tier: &'t DiskTier,
    l1: &'t L1,
    regs: &'t dyn Registrations,
    queue: WriteQueue<'t>,
    /// The pool registered with `queue` as fixed buffers, as it grows.
    fixed: FixedPool,
    bufs: Buffers,
    writing: HashMap<u64, Writing>,
    next_tag: u64,
    held_bytes: u64,
    cap_bytes: u64,
    /// Pages written from, copied out or not needed, to give back to L1's free pages.
    release: Vec<EntryId>,
    release_bytes: u64,
    /// Chunks written, to record in the index, and their page bytes.
    done: Vec<(Key, super::index::Loc)>,
    done_bytes: u64,
    /// Chunks recorded in the index since L1 was last told (it marks its copies on disk).
    committed: Vec<Key>,
    completions: Vec<Completion>,
    /// Pages hashed ahead, several at a time ([`Writer::hash_ahead`]), by entry.
    hashes: HashMap<EntryId, u64>,
}

/// The write thread: writes what L1 evicts until the tier stops; probes failed drives.
pub fn write_loop(
    tier: &DiskTier,
    l1: &L1,
    regs: &dyn Registrations,
    kick: crossbeam_channel::Receiver<()>,
) {
    let entries = (tier.config.queue_depth * tier.drives.len()) as u32;
    let probe_ring = ring_for(tier);
    let queue = match WriteQueue::new(entries, tier.config.queue_depth) {
        Ok(q) => Some(q),
        Err(e) => {
            let why = format!(
                "io_uring could not be set up for writes ({e}); nothing is written to disk"
            );
            tracing::error!("{why}");
            tier.note_error("setup", "io", &why);
            None
        }
    };
    let (Some(mut probe_ring), Some(queue)) = (probe_ring, queue) else {
        // No ring: the victims' pages are freed unwritten.
        loop {
            let _ = kick.recv_timeout(Duration::from_millis(100));
            let ids: Vec<EntryId> = l1
                .cache()
                .take_demotions()
                .iter()
                .map(|d| d.ticket)
                .collect();
            l1.cache().finish_demotions(&ids);
            if tier.stopping() {
                return;
            }
        }
    };
    let mut w = Writer {
        tier,
        l1,
        regs,
        queue,
        fixed: FixedPool::new("write"),
        bufs: Buffers::default(),
        writing: HashMap::new(),
        next_tag: 0,
        held_bytes: 0,
        cap_bytes: tier.config.write_queue_bytes.max(1),
        release: Vec::new(),
        release_bytes: 0,
        done: Vec::new(),
        done_bytes: 0,
        committed: Vec::new(),
        completions: Vec::new(),
        hashes: HashMap::new(),
    };
    let mut backlog: VecDeque<Demotion> = VecDeque::new();
    let mut last_probe = Instant::now();
    let (mut skipped, mut on_disk, mut not_admitted) = (0, 0, 0);
    loop {
        // The cache's lock is taken only when eviction kicked (or once idle), never once per
        // completion: lookups, stores and /metrics contend for it, and a write thread queued
        // behind them leaves the drive without its next write.
        let look = if backlog.is_empty() && w.queue.pending() == 0 {
            let _ = kick.recv_timeout(Duration::from_millis(100));
            true
        } else {
            kick.try_recv().is_ok()
        };
        if look {
            w.fixed.refresh(tier, l1, &mut w.queue);
        }
        if look || tier.stopping() {
            let (pending, now_skipped, now_on_disk, now_not_admitted) = {
                let mut cache = l1.cache();
                (
                    cache.take_demotions(),
                    cache.demotions_skipped(),
                    cache.evicted_on_disk(),
                    cache.demotions_not_admitted(),
                )
            };
            if !pending.is_empty() && !tier.config.inject_write_delay.is_zero() {
                std::thread::sleep(tier.config.inject_write_delay);
            }
            backlog.extend(pending);
            let evicted = &tier.metrics.evicted;
            evicted
                .with_label_values(&["dropped_busy"])
                .inc_by(now_skipped - skipped);
            evicted
                .with_label_values(&["present"])
                .inc_by(now_on_disk - on_disk);
            evicted
                .with_label_values(&["not_admitted"])
                .inc_by(now_not_admitted - not_admitted);
            (skipped, on_disk, not_admitted) = (now_skipped, now_on_disk, now_not_admitted);
        }
        if tier.stopping() {
            // Writes in flight complete and are recorded; the rest are not written.
            w.release.extend(backlog.drain(..).map(|d| d.ticket));
            w.hashes.clear();
            w.release_pages();
            while w.queue.pending() > 0 {
                w.poll(true);
            }
            w.commit();
            return;
        }
        // Copy chunks out while buffers allow, submitting each as soon as it is sealed, so the
        // drive writes one while the next is copied.
        w.hash_ahead(&backlog);
        while w.held_bytes < w.cap_bytes {
            let Some(d) = backlog.pop_front() else {
                break;
            };
            w.prepare(&d);
            w.poll(false);
        }
        w.release_pages();
        if w.queue.pending() > 0 {
            let more = !backlog.is_empty() && w.held_bytes < w.cap_bytes;
            w.poll(!more);
        }
        w.commit();
        if last_probe.elapsed() >= PROBE_EVERY {
            last_probe = Instant::now();
            probe(tier, &mut probe_ring, &mut w.bufs);
        }
    }
}

impl Writer<'_> {
    /// Queues the writes of one chunk handed over (or counts why not); its page is released
    /// once its writes complete when they read it in place, else at once.
    fn prepare(&mut self, d: &Demotion) {
        match self.copy_out(d) {
            Queued::InPlace => {}
            // Only now, with its bytes copied (or not needed), may the page take another
            // chunk; it stays in L1 only where the disk holds it already.
            Queued::Present | Queued::Copied | Queued::Not => self.release(d.ticket, d.page_bytes),
        }
    }

    fn release(&mut self, entry: EntryId, page_bytes: u64) {
        self.release.push(entry);
        self.release_bytes += page_bytes;
        if self.release_bytes >= RELEASE_EVERY_BYTES {
            self.release_pages();
        }
    }

    /// Hashes the pages of the next chunks to be written in place on several threads, when
    /// together they are large enough to be worth it ([`in_parallel`]); smaller batches are
    /// left to [`Writer::write_in_place`], which hashes each page itself. The page is pinned
    /// (unchanged) from its hand-over until its writes complete, so a hash taken now
    /// stays true. On the H200 host this took the write thread off the drive's path (it had
    /// been busy 0.43 of the write phase), for 0.77 → 0.80–0.85 of fio's write rate.
    fn hash_ahead(&mut self, backlog: &VecDeque<Demotion>) {
        let room = self.cap_bytes.saturating_sub(self.held_bytes);
        let mut todo: Vec<&Demotion> = Vec::new();
        let mut taken = 0u64;
        for d in backlog {
            if taken >= room || todo.len() >= HASH_AHEAD {
                break;
            }
            taken += d.page_bytes;
            if !self.hashes.contains_key(&d.ticket)
                && apart(d.page_bytes)
                && d.offset.is_multiple_of(ALIGN as u64)
            {
                todo.push(d);
            }
        }
        if todo.iter().map(|d| d.page_bytes).sum::<u64>() < 2 * CHECK_SPLIT_BYTES {
            return;
        }
        let Some(pool) = self.l1.memory().cloned() else {
            return;
        };
        // Chunks already on disk are not written again: not worth hashing.
        {
            let index = self.tier.index.lock();
            todo.retain(|d| index.get(&d.key).is_none());
        }
        let bytes = todo.iter().map(|d| d.page_bytes).sum();
        let hashes = in_parallel(todo.len(), bytes, |i| {
            pool.xxh3(todo[i].offset, todo[i].page_bytes).ok()
        });
        for (d, h) in todo.iter().zip(hashes) {
            if let Some(h) = h {
                self.hashes.insert(d.ticket, h);
            }
        }
    }

    /// Queues the writes of one chunk.
    fn copy_out(&mut self, d: &Demotion) -> Queued {
        let (tier, m) = (self.tier, &self.tier.metrics);
        let hashed = self.hashes.remove(&d.ticket);
        if tier.index.lock().get(&d.key).is_some() {
            m.evicted.with_label_values(&["present"]).inc();
            return Queued::Present;
        }
        let digest = self
            .regs
            .pages(d.key.fingerprint, &[d.key.shard])
            .and_then(|p| p.first().map(|&(_, (_, digest))| digest));
        let pool = self.l1.memory().cloned();
        let (Some(digest), Some(pool)) = (digest, pool) else {
            m.evicted.with_label_values(&["dropped_unregistered"]).inc();
            return Queued::Not;
        };
        let Some(alloc) = tier.index.lock().allocate(value_bytes(d.page_bytes)) else {
            m.evicted.with_label_values(&["failed"]).inc();
            return Queued::Not;
        };
        if apart(d.page_bytes) && d.offset.is_multiple_of(ALIGN as u64) {
            if self
                .write_in_place(d, &pool, digest, alloc, hashed)
                .is_some()
            {
                return Queued::InPlace;
            }
            m.evicted.with_label_values(&["failed"]).inc();
            return Queued::Not;
        }
        let mut buf = match self.bufs.take(alloc.len as usize) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("disk tier: no memory for a write buffer: {e}");
                m.evicted.with_label_values(&["failed"]).inc();
                return Queued::Not;
            }
        };
        let page = d.page_bytes as usize;
        let codec = value::Codec::default();
        let name = disk_name(&d.key);
        let v = &mut buf.as_mut_slice()[..alloc.len as usize];
        let header = if apart(d.page_bytes) {
            ALIGN
        } else {
            value::HEADER_V1_BYTES
        };
        let (head, rest) = v.split_at_mut(header);
        if let Err(e) = pool.read(d.offset, &mut rest[..page]) {
            tracing::warn!("reading an evicted chunk for the disk: {e}");
            m.evicted.with_label_values(&["failed"]).inc();
            self.bufs.give(buf);
            return Queued::Not;
        }
        // Zero what the header and the last block do not use: no stale bytes on disk.
        head.fill(0);
        rest[page..].fill(0);
        codec.seal_apart(head, &rest[..page], digest, &name);
        let buf = Arc::new(buf);
        let tag = self.next_tag;
        self.next_tag += 1;
        let drive = alloc.loc.drive as usize;
        let fd = tier.drives[drive].io_fd();
        let io = tier.config.io_bytes;
        let mut left = 0;
        for at in (0..alloc.len as usize).step_by(io) {
            let end = (at + io).min(alloc.len as usize);
            if let Err(e) = self
                .queue
                .push(fd, alloc.offset + at as u64, &buf, at..end, drive, tag)
            {
                tracing::error!("disk tier: a write could not be queued: {e}");
                break;
            }
            left += 1;
        }
        self.start(tag, d, alloc, buf, left, None);
        Queued::Copied
    }

    /// Queues a chunk's header block from a buffer and its page straight from L1 (no copy;
    /// the page stays held, unchanged, until the writes complete).
    fn write_in_place(
        &mut self,
        d: &Demotion,
        pool: &Arc<kvd_gpu::PoolMemory>,
        digest: u64,
        alloc: Alloc,
        hashed: Option<u64>,
    ) -> Option<()> {
        let page = d.page_bytes as usize;
        let src = match (
            pool.page(d.offset, d.page_bytes),
            hashed.map_or_else(|| pool.xxh3(d.offset, d.page_bytes), Ok),
        ) {
            (Ok(src), Ok(hash)) => Some((src, hash)),
            (Err(e), _) | (_, Err(e)) => {
                tracing::warn!("reading an evicted chunk for the disk: {e}");
                None
            }
        };
        let (src, hash) = src?;
        let mut head = self
            .bufs
            .take(ALIGN)
            .map_err(|e| tracing::warn!("disk tier: no memory for a header buffer: {e}"))
            .ok()?;
        head.as_mut_slice().fill(0);
        value::seal_v1(
            head.as_mut_slice(),
            d.page_bytes,
            hash,
            digest,
            &disk_name(&d.key),
        );
        let head = Arc::new(head);
        let src = Source::Raw(Arc::new(src));
        let tag = self.next_tag;
        self.next_tag += 1;
        let drive = alloc.loc.drive as usize;
        let fd = self.tier.drives[drive].io_fd();
        let io = self.tier.config.io_bytes;
        let mut left = 0;
        let mut pushed = self
            .queue
            .push(fd, alloc.offset, &head, 0..ALIGN, drive, tag)
            .map(|()| left += 1);
        for at in (0..page).step_by(io) {
            if pushed.is_err() {
                break;
            }
            let end = (at + io).min(page);
            let offset = alloc.offset + (ALIGN + at) as u64;
            pushed = self
                .queue
                .push_from(fd, offset, src.clone(), at..end, drive, tag)
                .map(|()| left += 1);
        }
        if let Err(e) = pushed {
            tracing::error!("disk tier: a write could not be queued: {e}");
        }
        self.start(tag, d, alloc, head, left, Some(d.ticket));
        Some(())
    }

    fn start(
        &mut self,
        tag: u64,
        d: &Demotion,
        alloc: Alloc,
        buf: Arc<AlignedBuf>,
        left: usize,
        page: Option<EntryId>,
    ) {
        self.held_bytes += alloc.len;
        self.writing.insert(
            tag,
            Writing {
                key: d.key,
                alloc,
                page_bytes: d.page_bytes,
                buf,
                left,
                error: None,
                page,
            },
        );
        if left == 0 {
            self.finish(tag);
        }
    }

    /// Submits, reaps, and settles every chunk whose last piece completed.
    fn poll(&mut self, wait: bool) {
        self.queue.poll(wait, &mut self.completions);
        self.fixed.count(self.tier, &mut self.queue);
        let completions = std::mem::take(&mut self.completions);
        for c in &completions {
            let Some(w) = self.writing.get_mut(&c.tag) else {
                continue;
            };
            w.left -= 1;
            if let (Err(e), None) = (&c.result, &w.error) {
                w.error = Some(std::io::Error::new(e.kind(), e.to_string()));
            }
            if w.left == 0 {
                self.finish(c.tag);
            }
        }
        self.completions = completions;
        self.completions.clear();
        self.release_pages();
    }

    fn finish(&mut self, tag: u64) {
        let Some(w) = self.writing.remove(&tag) else {
            return;
        };
        self.held_bytes -= w.alloc.len;
        match (w.error, w.left) {
            (None, 0) => {
                self.done.push((w.key, w.alloc.loc));
                self.done_bytes += w.page_bytes;
            }
            (Some(e), _) => {
                self.tier
                    .fail_drive(w.alloc.loc.drive as usize, "write", &e);
                self.tier
                    .metrics
                    .evicted
                    .with_label_values(&["failed"])
                    .inc();
            }
            (None, _) => self
                .tier
                .metrics
                .evicted
                .with_label_values(&["failed"])
                .inc(),
        }
        // The queue let go of it, and of the page, with the last completion.
        if let Ok(b) = Arc::try_unwrap(w.buf) {
            self.bufs.give(b);
        }
        if let Some(entry) = w.page {
            self.release(entry, w.page_bytes);
        }
    }

    /// Gives the pages written from, copied out or not needed back to L1's free pages, after
    /// recording what was written.
    fn release_pages(&mut self) {
        if self.release.is_empty() {
            return;
        }
        self.commit();
        {
            let mut cache = self.l1.cache();
            cache.finish_demotions(&self.release);
            // A chunk taken back or stored again while it was being written is on disk now.
            cache.known_on_disk(&self.committed);
        }
        self.committed.clear();
        self.tier.metrics.released.inc_by(self.release.len() as u64);
        self.release.clear();
        self.release_bytes = 0;
    }

    /// Records the chunks written since the last call in the index and the journal.
    fn commit(&mut self) {
        if self.done.is_empty() {
            return;
        }
        let m = &self.tier.metrics;
        let kept = self.tier.commit(&self.done);
        m.evicted
            .with_label_values(&["written"])
            .inc_by(kept.len() as u64);
        m.evicted
            .with_label_values(&["failed"])
            .inc_by((self.done.len() - kept.len()) as u64);
        self.committed.extend(kept);
        // Chunk bytes, as kvd_disk_bytes_total{direction="read"} counts them: no headers.
        m.bytes
            .with_label_values(&["write"])
            .inc_by(self.done_bytes);
        self.done.clear();
        self.done_bytes = 0;
        self.tier.refresh_gauges();
    }
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
