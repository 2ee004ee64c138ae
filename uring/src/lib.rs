//! kvd's io_uring layer, and with `kvd-gpu` the only crate of kvd with `unsafe` code: the disk
//! tier (in `kvd-server`, which forbids `unsafe`) reads and writes its drives through it.
//!
//! Layering as in cudarc: the `io-uring` crate is the raw layer (rings, opcodes, and the one
//! `unsafe fn` that matters, `push`); [`Ring::run`] is the safe owning layer above it. Its
//! contract is what makes `push` sound: every operation of a batch borrows its buffer for the
//! whole call, and the call returns only after the kernel has completed every operation it
//! was given — so no buffer is freed or reused while the kernel may still write into it. When
//! that can no longer be known (the ring itself fails), the process aborts rather than return.
//!
//! Many operations are in flight at once, up to a depth per *lane* (one lane per drive): one
//! read in flight per drive is what held LMCache's raw-block tier to 1.2 GB/s of an 11.3 GB/s
//! drive. Short transfers are resumed where they stopped; a read that meets the end of the file
//! fails with `UnexpectedEof`.
//!
//! Buffers for `O_DIRECT` must be aligned to the drive's logical block; [`AlignedBuf`] is an
//! anonymous mapping, so page-aligned. Memory that Rust never borrows as a slice — kvd's L1
//! pool, which GPUs reach by DMA — is read into through [`RawBytes`], so that a value read from
//! disk lands in its L1 page without a bounce buffer.
//!
//! Two shapes of use: [`Ring::run`] runs one batch to the end (one lookup's reads, all issued
//! together), and [`WriteQueue`] keeps a drive busy across batches (write-out: the next chunk is
//! prepared while the previous ones are in flight). Either can register raw memory as fixed
//! buffers (`register_fixed`, then `extend_fixed` as more of it is ready; see [`fixed`]): I/O
//! into registered memory then uses `ReadFixed`/`WriteFixed`, the rest the plain opcodes.

pub mod fixed;
mod stream;

pub use fixed::{FixedBuffers, OpCounts, MAX_FIXED_PIECE_BYTES};
pub use stream::{Completion, Source, WriteQueue};

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use io_uring::{opcode, types, IoUring};

/// Alignment every `O_DIRECT` offset, length and buffer here honours.
pub const ALIGN: usize = 4096;

/// A zeroed, page-aligned buffer (an anonymous mapping), for `O_DIRECT` transfers.
#[derive(Debug)]
pub struct AlignedBuf {
    map: memmap2::MmapMut,
    len: usize,
}

impl AlignedBuf {
    /// A buffer of `len` bytes (its mapping is rounded up to a page).
    pub fn new(len: usize) -> io::Result<AlignedBuf> {
        let map = memmap2::MmapMut::map_anon(len.max(1).next_multiple_of(ALIGN))?;
        Ok(AlignedBuf { map, len })
    }

    /// Bytes it was made for.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of its mapping (`len` rounded up to [`ALIGN`]).
    pub fn capacity(&self) -> usize {
        self.map.len()
    }

    /// The whole mapping.
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    /// The whole mapping, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// Memory outside Rust's borrows that the kernel may write into, such as the L1 pool (only
/// ever touched through raw copies and DMA).
///
/// # Safety
///
/// An implementation guarantees that `as_mut_ptr()..as_mut_ptr() + len()` is mapped and
/// writable for as long as the value lives, and that no Rust reference covers those bytes in
/// that time (who may write them is then up to its owner, as for DMA).
pub unsafe trait RawBytes: Sync {
    /// The first byte.
    fn as_mut_ptr(&self) -> *mut u8;
    /// Bytes from it.
    fn len(&self) -> usize;
    /// Whether it is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What an operation does with its buffer.
pub enum Buf<'a> {
    /// Read from the file into it.
    Read(&'a mut [u8]),
    /// Read from the file into `len` bytes at `at` of raw memory (checked against its length).
    ReadRaw {
        /// The memory.
        target: &'a dyn RawBytes,
        /// First byte of it to fill.
        at: usize,
        /// Bytes to fill.
        len: usize,
    },
    /// Write it to the file.
    Write(&'a [u8]),
}

impl std::fmt::Debug for Buf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Buf::Read(b) => write!(f, "Read({} bytes)", b.len()),
            Buf::ReadRaw { at, len, .. } => write!(f, "ReadRaw({len} bytes at {at})"),
            Buf::Write(b) => write!(f, "Write({} bytes)", b.len()),
        }
    }
}

impl Buf<'_> {
    fn len(&self) -> usize {
        match self {
            Buf::Read(b) => b.len(),
            Buf::ReadRaw { len, .. } => *len,
            Buf::Write(b) => b.len(),
        }
    }

    /// Whether the bytes it names exist (a raw range inside its target).
    fn fits(&self) -> bool {
        match self {
            Buf::ReadRaw { target, at, len } => {
                at.checked_add(*len).is_some_and(|end| end <= target.len())
            }
            _ => true,
        }
    }
}

/// One read or write of a batch.
#[derive(Debug)]
pub struct Op<'a> {
    /// The file.
    pub fd: BorrowedFd<'a>,
    /// Byte offset in the file.
    pub offset: u64,
    /// The buffer, borrowed until [`Ring::run`] returns.
    pub buf: Buf<'a>,
    /// Which lane's depth it counts against (the drive's index).
    pub lane: usize,
}

/// An io_uring instance that runs batches of reads and writes.
pub struct Ring {
    // Dropped first: the registration goes with it, before `fixed` lets go of the memory.
    ring: IoUring,
    entries: usize,
    fixed: Option<fixed::Fixed>,
    counts: OpCounts,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("entries", &self.entries)
            .field("fixed", &self.fixed)
            .finish()
    }
}

/// `register_fixed` for both kinds of ring.
pub(crate) fn register_fixed(
    ring: &IoUring,
    table: &mut Option<fixed::Fixed>,
    mem: Arc<dyn RawBytes + Send>,
    piece_bytes: usize,
) -> io::Result<()> {
    if table.is_some() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "this ring already has fixed buffers",
        ));
    }
    *table = Some(fixed::Fixed::new(ring, mem, piece_bytes)?);
    Ok(())
}

/// Largest single transfer: the kernel's cap on one read or write (`MAX_RW_COUNT`).
const MAX_IO_BYTES: usize = 0x7fff_f000;

impl Ring {
    /// A ring with room for `entries` operations in flight.
    pub fn new(entries: u32) -> io::Result<Ring> {
        let entries = entries.clamp(1, 4096).next_power_of_two();
        Ok(Ring {
            ring: IoUring::new(entries)?,
            entries: entries as usize,
            fixed: None,
            counts: OpCounts::default(),
        })
    }

    /// Runs every operation of `ops`, at most `depth` in flight per lane (and at most the
    /// ring's size in all), and returns one result per operation, in order. Returns only when
    /// the kernel is done with every buffer.
    pub fn run(&mut self, ops: &mut [Op<'_>], depth: usize) -> Vec<io::Result<()>> {
        let depth = depth.max(1);
        let lanes = ops.iter().map(|o| o.lane + 1).max().unwrap_or(0);
        let mut in_lane = vec![0usize; lanes];
        let mut done = vec![0usize; ops.len()];
        let mut results: Vec<Option<io::Result<()>>> = (0..ops.len()).map(|_| None).collect();
        // Operations not yet submitted (or to resume after a short transfer), oldest first.
        let mut waiting: std::collections::VecDeque<usize> = Default::default();
        for (i, op) in ops.iter().enumerate() {
            if op.buf.fits() {
                waiting.push_back(i);
            } else {
                results[i] = Some(Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "a raw read's range lies outside its target",
                )));
            }
        }
        let mut in_flight = 0usize;
        loop {
            // Fill the ring: one pass over what waits, skipping lanes that are at their depth.
            let mut skipped = std::collections::VecDeque::new();
            while let Some(i) = waiting.pop_front() {
                let op = &mut ops[i];
                if in_flight >= self.entries || in_lane[op.lane] >= depth {
                    skipped.push_back(i);
                    continue;
                }
                let at = done[i];
                let len = (op.buf.len() - at).min(MAX_IO_BYTES) as u32;
                let fd = types::Fd(op.fd.as_raw_fd());
                let entry = match &mut op.buf {
                    Buf::Read(b) => {
                        self.counts.plain += 1;
                        opcode::Read::new(fd, b[at..].as_mut_ptr(), len)
                            .offset(op.offset + at as u64)
                            .build()
                    }
                    Buf::ReadRaw {
                        target, at: base, ..
                    } => {
                        let ptr = target.as_mut_ptr().wrapping_add(*base + at);
                        match self.fixed.as_ref().and_then(|f| f.slot(ptr, len as usize)) {
                            Some(slot) => {
                                self.counts.fixed += 1;
                                opcode::ReadFixed::new(fd, ptr, len, slot)
                                    .offset(op.offset + at as u64)
                                    .build()
                            }
                            None => {
                                self.counts.plain += 1;
                                opcode::Read::new(fd, ptr, len)
                                    .offset(op.offset + at as u64)
                                    .build()
                            }
                        }
                    }
                    Buf::Write(b) => {
                        self.counts.plain += 1;
                        opcode::Write::new(fd, b[at..].as_ptr(), len)
                            .offset(op.offset + at as u64)
                            .build()
                    }
                };
                // SAFETY: the entry points into `ops[i]`'s buffer, at `at..at+len` within it
                // (for `ReadRaw`, `Buf::fits` checked the range against the target, which
                // `RawBytes` promises is mapped, writable and unborrowed; a fixed read's slot
                // is the registered piece that `Fixed::slot` found holding that range, which
                // stays registered and mapped while the ring lives), and that buffer is
                // borrowed for this whole call, which does not return until this entry's
                // completion has been reaped below; the fd is borrowed likewise.
                let pushed = unsafe { self.ring.submission().push(&entry.user_data(i as u64)) };
                if pushed.is_err() {
                    // The submission queue is full: submit what is there, try again later.
                    skipped.push_back(i);
                    break;
                }
                in_flight += 1;
                in_lane[op.lane] += 1;
            }
            skipped.extend(waiting.drain(..));
            waiting = skipped;
            if in_flight == 0 {
                break;
            }
            // Wait for at least one completion. Errors here mean the kernel may or may not
            // have taken the queued entries; retry the ones that say so, abort on the rest.
            loop {
                match self.ring.submit_and_wait(1) {
                    Ok(_) => break,
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc_errno::EINTR | libc_errno::EAGAIN | libc_errno::EBUSY)
                        ) =>
                    {
                        continue
                    }
                    Err(e) => {
                        eprintln!(
                            "kvd-uring: io_uring_enter failed with {e} while buffers are in \
                             flight; aborting rather than free memory the kernel may write"
                        );
                        std::process::abort();
                    }
                }
            }
            for cqe in self.ring.completion() {
                let i = cqe.user_data() as usize;
                let Some(op) = ops.get(i) else {
                    eprintln!("kvd-uring: a completion for an unknown operation {i}; aborting");
                    std::process::abort();
                };
                in_flight -= 1;
                in_lane[op.lane] -= 1;
                let res = cqe.result();
                if res < 0 {
                    results[i] = Some(Err(io::Error::from_raw_os_error(-res)));
                } else if res == 0 && op.buf.len() > done[i] {
                    results[i] = Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        format!(
                            "{} at byte {} of the file ended early",
                            if !matches!(op.buf, Buf::Write(_)) {
                                "a read"
                            } else {
                                "a write"
                            },
                            op.offset + done[i] as u64
                        ),
                    )));
                } else {
                    done[i] += res as usize;
                    if done[i] >= op.buf.len() {
                        results[i] = Some(Ok(()));
                    } else {
                        // A short transfer: resume it first.
                        waiting.push_front(i);
                    }
                }
            }
        }
        results
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(io::Error::other("operation never completed"))))
            .collect()
    }
}

impl FixedBuffers for Ring {
    fn register_fixed(
        &mut self,
        mem: Arc<dyn RawBytes + Send>,
        piece_bytes: usize,
    ) -> io::Result<()> {
        register_fixed(&self.ring, &mut self.fixed, mem, piece_bytes)
    }

    fn extend_fixed(&mut self, ready_bytes: usize) -> io::Result<usize> {
        match &mut self.fixed {
            Some(f) => f.extend(&self.ring, ready_bytes),
            None => Ok(0),
        }
    }

    fn fixed_bytes(&self) -> usize {
        self.fixed.as_ref().map_or(0, fixed::Fixed::bytes)
    }

    fn take_op_counts(&mut self) -> OpCounts {
        std::mem::take(&mut self.counts)
    }
}

/// The errno values the ring retries on (stable across Linux architectures kvd runs on).
mod libc_errno {
    pub const EINTR: i32 = 4;
    pub const EAGAIN: i32 = 11;
    pub const EBUSY: i32 = 16;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    /// A read-write file in the temp directory, already unlinked (gone when dropped).
    pub(crate) fn temp_file(name: &str) -> std::fs::File {
        let path = std::env::temp_dir().join(format!("kvd-uring-{}-{name}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    fn a_batch_of_writes_reads_back_bit_exact_across_lanes() {
        let (a, b) = (temp_file("a"), temp_file("b"));
        let mut ring = Ring::new(8).unwrap();
        let blocks: Vec<Vec<u8>> = (0..40u8).map(|i| vec![i; ALIGN]).collect();
        let mut writes: Vec<Op<'_>> = blocks
            .iter()
            .enumerate()
            .map(|(i, blk)| Op {
                fd: if i % 2 == 0 { a.as_fd() } else { b.as_fd() },
                offset: (i / 2 * ALIGN) as u64,
                buf: Buf::Write(blk),
                lane: i % 2,
            })
            .collect();
        assert!(ring.run(&mut writes, 3).iter().all(|r| r.is_ok()));
        let mut back: Vec<Vec<u8>> = (0..40).map(|_| vec![0u8; ALIGN]).collect();
        let mut reads: Vec<Op<'_>> = back
            .iter_mut()
            .enumerate()
            .map(|(i, blk)| Op {
                fd: if i % 2 == 0 { a.as_fd() } else { b.as_fd() },
                offset: (i / 2 * ALIGN) as u64,
                buf: Buf::Read(blk),
                lane: i % 2,
            })
            .collect();
        assert!(ring.run(&mut reads, 16).iter().all(|r| r.is_ok()));
        assert_eq!(back, blocks);
    }

    #[test]
    fn a_read_past_the_end_fails_alone() {
        let f = temp_file("eof");
        let mut ring = Ring::new(4).unwrap();
        let data = vec![7u8; ALIGN];
        assert!(ring.run(
            &mut [Op {
                fd: f.as_fd(),
                offset: 0,
                buf: Buf::Write(&data),
                lane: 0
            }],
            1
        )[0]
        .is_ok());
        let (mut x, mut y) = (vec![0u8; ALIGN], vec![0u8; ALIGN]);
        let r = ring.run(
            &mut [
                Op {
                    fd: f.as_fd(),
                    offset: 0,
                    buf: Buf::Read(&mut x),
                    lane: 0,
                },
                Op {
                    fd: f.as_fd(),
                    offset: ALIGN as u64,
                    buf: Buf::Read(&mut y),
                    lane: 0,
                },
            ],
            2,
        );
        assert!(r[0].is_ok());
        assert_eq!(
            r[1].as_ref().unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
        assert_eq!(x, data);
    }
}
