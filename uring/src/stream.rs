//! [`WriteQueue`]: writes that keep each drive's queue full across batches.
//!
//! [`crate::Ring::run`] returns only when its whole batch is done, so a caller that prepares
//! its next batch (copies evicted chunks out of L1) between two calls leaves the drive idle
//! meanwhile: that gap held the disk tier's write-out to 0.76–0.79 of fio (benches/RESULTS.md).
//! Here the caller pushes writes as it prepares them and polls for completions in between;
//! the ring submits as lanes have room.
//!
//! Soundness without borrowing across calls: the queue owns a reference to every buffer it
//! was given (`Arc<AlignedBuf>`, immutable while shared; or raw memory such as an L1 page,
//! `Arc<dyn RawBytes>`, mapped while it lives) until the kernel has completed the write that
//! reads it, and dropping the queue waits for every write in flight. A queue that is
//! leaked (`mem::forget`) leaks its buffers with it, so none is freed under the kernel either.

use std::collections::VecDeque;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use io_uring::{opcode, types, IoUring};

use crate::fixed::{Fixed, FixedBuffers, OpCounts};
use crate::{libc_errno, AlignedBuf, RawBytes, MAX_IO_BYTES};

/// A write that finished: its tag and how it went.
#[derive(Debug)]
pub struct Completion {
    /// The tag it was pushed with.
    pub tag: u64,
    /// Every byte written, or why not.
    pub result: io::Result<()>,
}

/// What a write reads from; the queue holds it until the write completes.
#[derive(Clone)]
pub enum Source {
    /// An aligned buffer (immutable while shared).
    Buf(Arc<AlignedBuf>),
    /// Raw memory, such as an L1 page: its owner keeps it unchanged until the write completes.
    Raw(Arc<dyn RawBytes + Send>),
}

impl Source {
    fn len(&self) -> usize {
        match self {
            Source::Buf(b) => b.capacity(),
            Source::Raw(r) => r.len(),
        }
    }

    fn ptr(&self, at: usize) -> *const u8 {
        match self {
            Source::Buf(b) => b.as_slice()[at..].as_ptr(),
            Source::Raw(r) => r.as_mut_ptr().wrapping_add(at).cast_const(),
        }
    }
}

impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Buf(b) => write!(f, "Buf({} bytes)", b.capacity()),
            Source::Raw(r) => write!(f, "Raw({} bytes)", r.len()),
        }
    }
}

#[derive(Debug)]
struct Piece<'fd> {
    fd: BorrowedFd<'fd>,
    offset: u64,
    buf: Source,
    range: Range<usize>,
    done: usize,
    lane: usize,
    tag: u64,
}

/// An io_uring instance for writes pushed one at a time and completed in any order, at most
/// `depth` in flight per lane (drive).
pub struct WriteQueue<'fd> {
    // Dropped after `Drop::drop` reaped every write, and before `fixed` lets go of the memory.
    ring: IoUring,
    entries: usize,
    fixed: Option<Fixed>,
    counts: OpCounts,
    depth: usize,
    in_lane: Vec<usize>,
    /// Submitted writes, by `user_data`.
    slots: Vec<Option<Piece<'fd>>>,
    free: Vec<usize>,
    /// Pushed, not yet submitted (or to resume after a short write), oldest first.
    waiting: VecDeque<Piece<'fd>>,
    waiting_bytes: usize,
}

impl std::fmt::Debug for WriteQueue<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteQueue")
            .field("entries", &self.entries)
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight())
            .field("waiting", &self.waiting.len())
            .finish()
    }
}

impl<'fd> WriteQueue<'fd> {
    /// A queue with room for `entries` writes in flight in all, `depth` per lane.
    pub fn new(entries: u32, depth: usize) -> io::Result<WriteQueue<'fd>> {
        let entries = entries.clamp(1, 4096).next_power_of_two();
        Ok(WriteQueue {
            ring: IoUring::new(entries)?,
            entries: entries as usize,
            fixed: None,
            counts: OpCounts::default(),
            depth: depth.max(1),
            in_lane: Vec::new(),
            slots: (0..entries).map(|_| None).collect(),
            free: (0..entries as usize).rev().collect(),
            waiting: VecDeque::new(),
            waiting_bytes: 0,
        })
    }

    /// Writes submitted to the kernel and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.entries - self.free.len()
    }

    /// Writes pushed and not yet completed (submitted or waiting for room).
    pub fn pending(&self) -> usize {
        self.in_flight() + self.waiting.len()
    }

    /// Bytes pushed and not yet submitted.
    pub fn waiting_bytes(&self) -> usize {
        self.waiting_bytes
    }

    /// Queues a write of `buf[range]` at byte `offset` of `fd`, counted against `lane`; it is
    /// submitted by the next [`WriteQueue::poll`] that finds room. Fails at once if `range`
    /// is not inside the buffer.
    pub fn push(
        &mut self,
        fd: BorrowedFd<'fd>,
        offset: u64,
        buf: &Arc<AlignedBuf>,
        range: Range<usize>,
        lane: usize,
        tag: u64,
    ) -> io::Result<()> {
        self.push_from(fd, offset, Source::Buf(buf.clone()), range, lane, tag)
    }

    /// As [`WriteQueue::push`], from any [`Source`] (an L1 page: no copy into a buffer).
    pub fn push_from(
        &mut self,
        fd: BorrowedFd<'fd>,
        offset: u64,
        buf: Source,
        range: Range<usize>,
        lane: usize,
        tag: u64,
    ) -> io::Result<()> {
        if range.start > range.end || range.end > buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a write of bytes {range:?} of a {}-byte buffer", buf.len()),
            ));
        }
        if self.in_lane.len() <= lane {
            self.in_lane.resize(lane + 1, 0);
        }
        self.waiting_bytes += range.len();
        self.waiting.push_back(Piece {
            fd,
            offset,
            buf,
            range,
            done: 0,
            lane,
            tag,
        });
        Ok(())
    }

    /// Submits what has room and appends finished writes to `out`. With `wait`, blocks until
    /// at least one write has finished, unless none is pending.
    pub fn poll(&mut self, wait: bool, out: &mut Vec<Completion>) {
        self.fill();
        let want = usize::from(wait && self.in_flight() > 0);
        loop {
            match self.ring.submit_and_wait(want) {
                Ok(_) => break,
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc_errno::EINTR | libc_errno::EAGAIN | libc_errno::EBUSY)
                    ) =>
                {
                    // EBUSY: the completion queue is full; reaping below makes room.
                    if e.raw_os_error() == Some(libc_errno::EBUSY) {
                        break;
                    }
                }
                Err(e) => {
                    eprintln!(
                        "kvd-uring: io_uring_enter failed with {e} while writes are in flight; \
                         aborting rather than free memory the kernel may read"
                    );
                    std::process::abort();
                }
            }
        }
        self.reap(out);
    }

    /// Pushes waiting writes into the submission queue while lanes and the ring have room.
    fn fill(&mut self) {
        let mut skipped = VecDeque::new();
        while let Some(p) = self.waiting.pop_front() {
            if self.in_lane[p.lane] >= self.depth {
                skipped.push_back(p);
                continue;
            }
            let Some(slot) = self.free.pop() else {
                skipped.push_back(p);
                break;
            };
            let at = p.range.start + p.done;
            let len = (p.range.end - at).min(MAX_IO_BYTES) as u32;
            let fd = types::Fd(p.fd.as_raw_fd());
            let ptr = p.buf.ptr(at);
            let fixed = match &p.buf {
                Source::Raw(_) => self.fixed.as_ref().and_then(|f| f.slot(ptr, len as usize)),
                Source::Buf(_) => None,
            };
            let entry = match fixed {
                Some(index) => {
                    self.counts.fixed += 1;
                    opcode::WriteFixed::new(fd, ptr, len, index)
                        .offset(p.offset + p.done as u64)
                        .build()
                }
                None => {
                    self.counts.plain += 1;
                    opcode::Write::new(fd, ptr, len)
                        .offset(p.offset + p.done as u64)
                        .build()
                }
            }
            .user_data(slot as u64);
            // SAFETY: the entry points at `len` bytes inside `p.buf` (`push_from` checked the
            // range against it; raw memory is mapped while its `RawBytes` lives; a fixed
            // write's index is the registered piece `Fixed::slot` found holding those bytes,
            // registered and mapped while the queue lives), and `p` —
            // holding a reference to that memory and borrowing the fd — moves into `slots[slot]`, where it stays until this entry's completion
            // is reaped; `Drop` reaps every one before the queue goes away.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                self.free.push(slot);
                skipped.push_back(p);
                break;
            }
            self.waiting_bytes -= p.range.len() - p.done;
            self.in_lane[p.lane] += 1;
            self.slots[slot] = Some(p);
        }
        skipped.extend(self.waiting.drain(..));
        self.waiting = skipped;
    }

    fn reap(&mut self, out: &mut Vec<Completion>) {
        let cqes: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (slot, res) in cqes {
            let Some(mut p) = self.slots.get_mut(slot as usize).and_then(Option::take) else {
                eprintln!("kvd-uring: a completion for an unknown write {slot}; aborting");
                std::process::abort();
            };
            self.free.push(slot as usize);
            self.in_lane[p.lane] -= 1;
            let left = p.range.len() - p.done;
            if res < 0 {
                out.push(Completion {
                    tag: p.tag,
                    result: Err(io::Error::from_raw_os_error(-res)),
                });
            } else if res == 0 && left > 0 {
                out.push(Completion {
                    tag: p.tag,
                    result: Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        format!(
                            "a write at byte {} of the file wrote nothing",
                            p.offset + p.done as u64
                        ),
                    )),
                });
            } else if (res as usize) < left {
                // A short write: resume it first.
                p.done += res as usize;
                self.waiting_bytes += p.range.len() - p.done;
                self.waiting.push_front(p);
            } else {
                out.push(Completion {
                    tag: p.tag,
                    result: Ok(()),
                });
            }
        }
    }
}

impl FixedBuffers for WriteQueue<'_> {
    fn register_fixed(
        &mut self,
        mem: Arc<dyn RawBytes + Send>,
        piece_bytes: usize,
    ) -> io::Result<()> {
        crate::register_fixed(&self.ring, &mut self.fixed, mem, piece_bytes)
    }

    fn extend_fixed(&mut self, ready_bytes: usize) -> io::Result<usize> {
        match &mut self.fixed {
            Some(f) => f.extend(&self.ring, ready_bytes),
            None => Ok(0),
        }
    }

    fn fixed_bytes(&self) -> usize {
        self.fixed.as_ref().map_or(0, Fixed::bytes)
    }

    fn take_op_counts(&mut self) -> OpCounts {
        std::mem::take(&mut self.counts)
    }
}

impl Drop for WriteQueue<'_> {
    /// Waits for every write in flight, so that no buffer is freed while the kernel reads it;
    /// writes not yet submitted are dropped.
    fn drop(&mut self) {
        self.waiting.clear();
        let mut out = Vec::new();
        while self.in_flight() > 0 {
            self.poll(true, &mut out);
            out.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn writes_pushed_between_polls_read_back_bit_exact() {
        let f = crate::tests::temp_file("q");
        let mut q = WriteQueue::new(4, 3).unwrap();
        let mut out = Vec::new();
        let mut bufs = Vec::new();
        for i in 0..10u8 {
            let mut b = AlignedBuf::new(2 * crate::ALIGN).unwrap();
            b.as_mut_slice().fill(i);
            let b = Arc::new(b);
            for half in 0..2 {
                let r = half * crate::ALIGN..(half + 1) * crate::ALIGN;
                let at = (2 * i as usize + half) * crate::ALIGN;
                q.push(f.as_fd(), at as u64, &b, r, 0, i as u64).unwrap();
            }
            bufs.push(b);
            q.poll(false, &mut out);
        }
        while q.pending() > 0 {
            q.poll(true, &mut out);
        }
        assert_eq!(out.len(), 20);
        assert!(out.iter().all(|c| c.result.is_ok()));
        // The queue let go of every buffer.
        assert!(bufs.iter().all(|b| Arc::strong_count(b) == 1));
        let mut back = vec![0u8; 20 * crate::ALIGN];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut back, 0).unwrap();
        for (i, blk) in back.chunks(2 * crate::ALIGN).enumerate() {
            assert!(blk.iter().all(|&x| x == i as u8), "chunk {i}");
        }
        let b = Arc::new(AlignedBuf::new(16).unwrap());
        assert!(q.push(f.as_fd(), 0, &b, 0..2 * crate::ALIGN, 0, 0).is_err());
    }
}
