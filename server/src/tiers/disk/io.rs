//! The disk tier's read thread, and what both its threads share. Each thread has its own ring
//! so that reads for lookups never queue behind write-out: `kvd-disk-read` (here) runs one
//! lookup's reads at a time, all of them in flight together; `kvd-disk-write` is in
//! [`super::writeout`].
//!
//! A value whose page is whole 4 KiB blocks lies on disk as a header block followed by the
//! page ([`apart`]), and is read straight into its L1 page (the pinned pool the GPU's DMA
//! reads; the drive's DMA writes it, no bounce buffer, no copy) while the entry is `Writing`,
//! invisible to lookups; its
//! checksum is then checked in place, and a page that fails it is freed, never reported as a
//! hit. Other values (tiny chunks, or written before this layout) go through an aligned bounce
//! buffer and are checked before a byte reaches the page.
//!
//! A chunk is read in `--disk-io-kb` pieces, up to `--disk-queue-depth` in flight per drive.
//! Buffers are aligned anonymous mappings, reused between jobs. The pool is registered with the
//! ring as fixed buffers as it becomes ready ([`super::fixed`]), so reads into pages are
//! `ReadFixed`; the thread registers more of it while idle.

use kvd_gpu::{PoolMemory, PoolSpan};
use kvd_uring::{AlignedBuf, Buf, Op, Ring, ALIGN};

use super::fixed::FixedPool;
use super::index::Loc;
use super::{disk_name, DiskTier};
use crate::l1::cache::Key;
use crate::l1::evict::EntryId;
use crate::l1::L1;
use crate::tiers::value;

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
    /// Chunks the lookup wanted of the disk (those it did not find or take count as misses).
    pub wanted: usize,
    /// When the lookup sent it.
    pub sent: std::time::Instant,
}

impl ReadJob {
    /// Bytes it reads.
    pub fn bytes(&self) -> u64 {
        self.items.iter().map(|it| it.len).sum()
    }
}

/// Reusable aligned buffers.
#[derive(Debug, Default)]
pub(crate) struct Buffers {
    free: Vec<AlignedBuf>,
    kept: usize,
}

impl Buffers {
    pub(crate) fn take(&mut self, len: usize) -> std::io::Result<AlignedBuf> {
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

    pub(crate) fn give(&mut self, b: AlignedBuf) {
        if self.kept + b.capacity() <= KEEP_BUFFER_BYTES {
            self.kept += b.capacity();
            self.free.push(b);
        }
    }
}

pub(crate) fn ring_for(tier: &DiskTier) -> Option<Ring> {
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
pub(crate) fn pieces<'a>(
    tier: &'a DiskTier,
    places: &[(usize, u64, u64)],
    bufs: &'a mut [AlignedBuf],
    write: bool,
) -> (Vec<Op<'a>>, Vec<usize>) {
    let io = tier.config.io_bytes;
    let mut ops = Vec::new();
    let mut owner = Vec::new();
    for (i, (buf, &(drive, offset, len))) in bufs.iter_mut().zip(places).enumerate() {
        let fd = tier.drives[drive].io_fd();
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
pub(crate) fn run(
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

/// Whether the value of a page of `page_bytes` lies apart from its header: the header in a
/// block of its own, the page block-aligned after it, so that a read can put it straight into
/// its L1 page. A page that is not whole blocks keeps its header in front (one block for a tiny
/// chunk, not two).
pub(crate) fn apart(page_bytes: u64) -> bool {
    page_bytes.is_multiple_of(ALIGN as u64)
}

/// Bytes on disk of the value of a page of `page_bytes` (before rounding up to a block).
pub(crate) fn value_bytes(page_bytes: u64) -> u64 {
    if apart(page_bytes) {
        ALIGN as u64 + page_bytes
    } else {
        value::HEADER_V1_BYTES as u64 + page_bytes
    }
}

/// The read thread: one job at a time until the channel closes.
pub fn read_loop(tier: &DiskTier, l1: &L1, jobs: crossbeam_channel::Receiver<ReadJob>) {
    let Some(mut ring) = ring_for(tier) else {
        return;
    };
    let mut bufs = Buffers::default();
    let mut fixed = FixedPool::new("read");
    loop {
        // Idle: register more of the pool as it becomes ready, so lookups find it done.
        let job = match jobs.recv_timeout(std::time::Duration::from_millis(100)) {
            Ok(job) => job,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                fixed.refresh(tier, l1, &mut ring);
                continue;
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
        };
        let started = std::time::Instant::now();
        if !tier.config.inject_delay.is_zero() {
            std::thread::sleep(tier.config.inject_delay);
        }
        fixed.refresh(tier, l1, &mut ring);
        read_job(tier, l1, &mut ring, &mut bufs, &job);
        fixed.count(tier, &mut ring);
        tier.reads_done(job.bytes(), Some(started.elapsed()));
        // Retrieves waiting for these chunks look again.
        tier.filled.notify_waiters();
    }
}

/// Where one value is read to.
enum Target<'p> {
    /// All of it into an aligned buffer, then checked and copied into the page.
    Bounce(AlignedBuf),
    /// Its header block into a buffer and its page straight into the L1 page.
    Page {
        head: AlignedBuf,
        span: PoolSpan<'p>,
    },
}

fn target<'p>(
    it: &ReadItem,
    pool: Option<&'p PoolMemory>,
    bufs: &mut Buffers,
) -> std::io::Result<Target<'p>> {
    let page = it.page_bytes;
    let span = (apart(page)
        && it.loc.value_bytes == value_bytes(page)
        && it.page_offset.is_multiple_of(ALIGN as u64))
    .then(|| pool?.span(it.page_offset, page).ok())
    .flatten();
    Ok(match span {
        Some(span) => Target::Page {
            head: bufs.take(ALIGN)?,
            span,
        },
        None => Target::Bounce(bufs.take(it.len as usize)?),
    })
}

/// The read ops of every target: a bounce buffer in `io_bytes` pieces, or a header block and
/// the page in `io_bytes` pieces.
fn read_ops<'a>(
    tier: &'a DiskTier,
    items: &[ReadItem],
    targets: &'a mut [Target<'_>],
) -> (Vec<Op<'a>>, Vec<usize>) {
    let io = tier.config.io_bytes;
    let mut ops = Vec::new();
    let mut owner = Vec::new();
    for (i, (t, it)) in targets.iter_mut().zip(items).enumerate() {
        let fd = tier.drives[it.loc.drive as usize].io_fd();
        let lane = it.loc.drive as usize;
        match t {
            Target::Bounce(b) => {
                for (p, piece) in b.as_mut_slice()[..it.len as usize]
                    .chunks_mut(io)
                    .enumerate()
                {
                    ops.push(Op {
                        fd,
                        offset: it.offset + (p * io) as u64,
                        buf: Buf::Read(piece),
                        lane,
                    });
                    owner.push(i);
                }
            }
            Target::Page { head, span } => {
                ops.push(Op {
                    fd,
                    offset: it.offset,
                    buf: Buf::Read(&mut head.as_mut_slice()[..ALIGN]),
                    lane,
                });
                owner.push(i);
                let page = it.page_bytes as usize;
                for at in (0..page).step_by(io) {
                    ops.push(Op {
                        fd,
                        offset: it.offset + (ALIGN + at) as u64,
                        buf: Buf::ReadRaw {
                            target: &*span,
                            at,
                            len: io.min(page - at),
                        },
                        lane,
                    });
                    owner.push(i);
                }
            }
        }
    }
    (ops, owner)
}

/// Checks a value that was read and, from a bounce buffer, copies it into its page; the
/// bytes put into the page, or why the value was rejected.
fn check(
    it: &ReadItem,
    target: &Target<'_>,
    pool: &PoolMemory,
) -> Result<Option<u64>, value::Rejected> {
    let codec = value::Codec::default();
    let name = disk_name(&it.key);
    let page = it.page_bytes;
    let copy = |payload: &[u8]| match pool.write(it.page_offset, payload) {
        Ok(()) => Some(payload.len() as u64),
        Err(e) => {
            tracing::warn!("writing a disk value into the pool: {e}");
            None
        }
    };
    match target {
        Target::Page { head, .. } => {
            let want = codec.open_apart(&head.as_slice()[..ALIGN], it.digest, &name, page)?;
            match pool.xxh3(it.page_offset, page) {
                Ok(got) if got == want => Ok(Some(page)),
                Ok(_) => Err(value::Rejected::Corrupt),
                Err(e) => {
                    tracing::warn!("checking a disk value in the pool: {e}");
                    Ok(None)
                }
            }
        }
        Target::Bounce(b) if it.loc.value_bytes == value_bytes(page) && apart(page) => {
            let (head, rest) = b.as_slice().split_at(ALIGN);
            let want = codec.open_apart(head, it.digest, &name, page)?;
            let payload = &rest[..page as usize];
            if xxhash_rust::xxh3::xxh3_64(payload) != want {
                return Err(value::Rejected::Corrupt);
            }
            Ok(copy(payload))
        }
        Target::Bounce(b) => {
            let v = &b.as_slice()[..it.loc.value_bytes as usize];
            // The disk is this node's own: checksummed values, no MAC (see tier/value.rs).
            Ok(copy(codec.open(v, it.digest, &name, page)?))
        }
    }
}

/// Read bytes worth a second checking thread: below it, starting one costs more than it saves.
pub(crate) const CHECK_SPLIT_BYTES: u64 = 8 << 20;

/// [`check`]s every value that was read without error — on several threads when the values are
/// large (a lookup's 32 MiB chunks: one core of the H200 host hashed ~5 GB/s, a third of the
/// time its drive took to read them, and checking them one after another added all of it to
/// every fill; issue 21). `None` for a value not read, or when there is no pool.
fn check_all(
    items: &[ReadItem],
    targets: &[Target<'_>],
    errors: &[Option<std::io::Error>],
    pool: Option<&PoolMemory>,
) -> Vec<Option<Result<Option<u64>, value::Rejected>>> {
    let Some(pool) = pool else {
        return items.iter().map(|_| None).collect();
    };
    let bytes: u64 = items.iter().map(|it| it.page_bytes).sum();
    in_parallel(items.len(), bytes, |i| {
        errors[i]
            .is_none()
            .then(|| check(&items[i], &targets[i], pool))
    })
}

/// `f(0..n)` in order, on up to eight threads when the `bytes` the calls hash are worth it
/// ([`CHECK_SPLIT_BYTES`] each), else on this one. Thread t takes t, t + threads, …
pub(crate) fn in_parallel<R: Send>(n: usize, bytes: u64, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism()
        .map_or(1, |p| p.get())
        .min(n)
        .min((bytes / CHECK_SPLIT_BYTES) as usize)
        .min(8);
    if threads <= 1 {
        return (0..n).map(f).collect();
    }
    let mut out: Vec<Option<R>> = (0..n).map(|_| None).collect();
    std::thread::scope(|s| {
        let f = &f;
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || {
                    (t..n)
                        .step_by(threads)
                        .map(|i| (i, f(i)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for w in workers {
            // A panic in `f` is a bug: let it reach the caller as it would have on one thread.
            for (i, r) in w.join().unwrap_or_else(|p| std::panic::resume_unwind(p)) {
                out[i] = Some(r);
            }
        }
    });
    out.into_iter().flatten().collect()
}

/// Reads one lookup's values — pages that are whole blocks straight into their `Filling` L1
/// pages, which no retrieve reads until they are checked — and finishes the entries: kept if
/// intact, dropped if not (a retrieve then finds them missing).
fn read_job(tier: &DiskTier, l1: &L1, ring: &mut Ring, bufs: &mut Buffers, job: &ReadJob) {
    let (items, chunks) = (&job.items[..], job.chunks);
    let m = &tier.metrics;
    let mut ok = vec![false; items.len()];
    let pool = l1.memory().cloned();
    let mut targets = Vec::with_capacity(items.len());
    for it in items {
        match target(it, pool.as_deref(), bufs) {
            Ok(t) => targets.push(t),
            Err(e) => {
                tracing::warn!("disk tier: no memory for a read buffer: {e}");
                break;
            }
        }
    }
    let n = targets.len();
    let (ops, owner) = read_ops(tier, &items[..n], &mut targets);
    let errors = run(ring, tier.config.queue_depth, ops, &owner, n);
    let checked = check_all(&items[..n], &targets, &errors, pool.as_deref());
    let mut bytes = 0u64;
    for (i, ((it, err), checked)) in items.iter().zip(errors).zip(checked).enumerate() {
        let reason = match err {
            Some(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Some("truncated"),
            Some(e) => {
                tier.fail_drive(it.loc.drive as usize, "read", &e);
                None
            }
            None => match checked {
                Some(Ok(Some(b))) => {
                    ok[i] = true;
                    bytes += b;
                    None
                }
                Some(Ok(None)) | None => None,
                Some(Err(why)) => Some(why.label()),
            },
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
    m.direct_reads.inc_by(
        targets
            .iter()
            .zip(&ok)
            .filter(|(t, ok)| **ok && matches!(t, Target::Page { .. }))
            .count() as u64,
    );
    for t in targets {
        match t {
            Target::Bounce(b) | Target::Page { head: b, .. } => bufs.give(b),
        }
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
    // Counted before the entries settle, so that whoever retrieves them sees the counts.
    m.fill_chunks
        .with_label_values(&["filled"])
        .inc_by(good.len() as u64);
    m.bytes.with_label_values(&["read"]).inc_by(bytes);
    m.lookup_chunks
        .with_label_values(&["hit"])
        .inc_by(bad_from as u64);
    m.lookup_chunks
        .with_label_values(&["miss"])
        .inc_by(job.wanted.saturating_sub(bad_from) as u64);
    m.fetch_seconds.observe(job.sent.elapsed().as_secs_f64());
    {
        let mut cache = l1.cache();
        cache.finish_store(&good, true);
        cache.finish_store(&bad, false);
    }
    tier.refresh_gauges();
}

#[cfg(test)]
mod tests {
    use super::{in_parallel, CHECK_SPLIT_BYTES};

    #[test]
    fn in_parallel_returns_every_result_in_order_from_several_threads() {
        let me = std::thread::current().id();
        // Enough bytes for eight threads: each call says which thread ran it.
        let out = in_parallel(37, 8 * CHECK_SPLIT_BYTES, |i| {
            (i * 3, std::thread::current().id())
        });
        assert_eq!(
            out.iter().map(|r| r.0).collect::<Vec<_>>(),
            (0..37).map(|i| i * 3).collect::<Vec<_>>()
        );
        if std::thread::available_parallelism().map_or(1, |p| p.get()) > 1 {
            assert!(
                out.iter().all(|r| r.1 != me),
                "the calls ran on other threads"
            );
            let mut ids: Vec<_> = out.iter().map(|r| format!("{:?}", r.1)).collect();
            ids.dedup();
            assert!(ids.len() > 1, "more than one thread");
        }
        // Too few bytes to be worth a thread: all on this one.
        let small = in_parallel(5, CHECK_SPLIT_BYTES, |_| std::thread::current().id());
        assert!(small.iter().all(|&id| id == me));
        assert!(in_parallel(0, u64::MAX, |i| i).is_empty());
    }
}
