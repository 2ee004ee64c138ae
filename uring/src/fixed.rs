//! Fixed buffers: memory registered with a ring once (`IORING_REGISTER_BUFFERS2`, a sparse
//! table filled piece by piece), so that a read or write into it names a table slot
//! (`ReadFixed`/`WriteFixed`) and the kernel skips pinning the pages of every I/O — the pool
//! is the buffer, as the disk tier's issue asks ("O_DIRECT on registered buffers").
//!
//! The memory is registered in pieces of at most 1 GiB (the kernel's limit for one buffer) and
//! only as far as its owner says it is ready: registering pins, so faults in, every page, and
//! kvd's pool is first-touched by its own threads (NUMA placement, hugepages) while it serves.
//! An I/O whose bytes lie in one registered piece uses the fixed opcode; any other (a header
//! buffer, a span across two pieces, memory not yet registered) the plain one. Registration
//! that fails (a kernel before 5.19, `RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`) leaves the ring
//! on plain opcodes, which do the same I/O.
//!
//! Soundness: the table holds an `Arc` of the memory for as long as the ring lives (its owner
//! drops the ring's `IoUring` first), so every registered address stays mapped while the
//! kernel may use it, and [`RawBytes`] promises no Rust reference covers those bytes.

use std::io;
use std::sync::Arc;

use io_uring::IoUring;

use crate::RawBytes;

/// The kernel's limit for one registered buffer.
pub const MAX_FIXED_PIECE_BYTES: usize = 1 << 30;

/// The kernel's limit on registered buffers per ring (`IORING_MAX_REG_BUFFERS`).
const MAX_SLOTS: usize = 1 << 14;

/// How many I/Os used a fixed buffer and how many a plain one, since the last
/// [`OpCounts`] was taken.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OpCounts {
    /// Submitted with `ReadFixed`/`WriteFixed`.
    pub fixed: u64,
    /// Submitted with plain `Read`/`Write`.
    pub plain: u64,
}

/// A ring that can register raw memory as fixed buffers: [`crate::Ring`] and
/// [`crate::WriteQueue`].
pub trait FixedBuffers {
    /// Sets up a table of fixed buffers for `mem`, in pieces of `piece_bytes` (at most
    /// [`MAX_FIXED_PIECE_BYTES`]); nothing is registered until
    /// [`FixedBuffers::extend_fixed`]. Fails where the kernel has no sparse tables (before
    /// 5.19) or the ring has one already.
    fn register_fixed(
        &mut self,
        mem: Arc<dyn RawBytes + Send>,
        piece_bytes: usize,
    ) -> io::Result<()>;

    /// Registers the pieces of the fixed memory that lie wholly in its first `ready_bytes`
    /// (and were not registered yet); returns the bytes registered in all (0 without a
    /// table).
    fn extend_fixed(&mut self, ready_bytes: usize) -> io::Result<usize>;

    /// Bytes registered as fixed buffers.
    fn fixed_bytes(&self) -> usize;

    /// The I/Os submitted with fixed and with plain opcodes since the last call.
    fn take_op_counts(&mut self) -> OpCounts;
}

/// One ring's table of registered pieces of one memory region.
pub(crate) struct Fixed {
    mem: Arc<dyn RawBytes + Send>,
    piece: usize,
    slots: usize,
    /// Pieces registered, from the first.
    registered: usize,
}

impl std::fmt::Debug for Fixed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fixed")
            .field("len", &self.mem.len())
            .field("piece", &self.piece)
            .field("registered", &self.registered)
            .finish()
    }
}

impl Fixed {
    /// Sets up an empty (sparse) table for `mem` in pieces of `piece_bytes`.
    pub(crate) fn new(
        ring: &IoUring,
        mem: Arc<dyn RawBytes + Send>,
        piece_bytes: usize,
    ) -> io::Result<Fixed> {
        if piece_bytes == 0 || piece_bytes > MAX_FIXED_PIECE_BYTES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("a fixed-buffer piece of {piece_bytes} bytes (1..=1 GiB)"),
            ));
        }
        let slots = mem.len().div_ceil(piece_bytes).clamp(1, MAX_SLOTS);
        ring.submitter().register_buffers_sparse(slots as u32)?;
        Ok(Fixed {
            mem,
            piece: piece_bytes,
            slots,
            registered: 0,
        })
    }

    /// Registers every further piece that lies wholly in the memory's first `ready_bytes`;
    /// returns the bytes registered in all. On an error the pieces before it stay registered.
    pub(crate) fn extend(&mut self, ring: &IoUring, ready_bytes: usize) -> io::Result<usize> {
        let len = self.mem.len();
        let ready = ready_bytes.min(len);
        while self.registered < self.slots {
            let start = self.registered * self.piece;
            let end = (start + self.piece).min(len);
            if end > ready || end <= start {
                break;
            }
            let iov = libc::iovec {
                iov_base: self.mem.as_mut_ptr().wrapping_add(start).cast(),
                iov_len: end - start,
            };
            // SAFETY: `iov` covers `start..end` of the memory, inside `0..len` which `RawBytes`
            // promises is mapped and writable while `self.mem` lives; `self` holds that Arc as
            // long as the ring does (the owner drops its `IoUring` first), so the buffer stays
            // valid until the registration goes with the ring, as `register_buffers_update`
            // requires.
            unsafe {
                ring.submitter()
                    .register_buffers_update(self.registered as u32, &[iov], None)?
            };
            self.registered += 1;
        }
        Ok(self.bytes())
    }

    /// Bytes registered.
    pub(crate) fn bytes(&self) -> usize {
        (self.registered * self.piece).min(self.mem.len())
    }

    /// The table slot whose piece holds `ptr..ptr + len`, when one registered piece does.
    pub(crate) fn slot(&self, ptr: *const u8, len: usize) -> Option<u16> {
        let base = self.mem.as_mut_ptr() as usize;
        let start = (ptr as usize).checked_sub(base)?;
        let last = start.checked_add(len.max(1) - 1)?;
        let i = start / self.piece;
        (i < self.registered && last / self.piece == i && last < self.mem.len())
            .then(|| u16::try_from(i).ok())
            .flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::temp_file;
    use crate::{Buf, FixedBuffers, Op, Ring, Source, WriteQueue, ALIGN};
    use std::os::fd::AsFd;

    /// An anonymous mapping only ever touched through raw pointers, like kvd's pool.
    struct Mem(memmap2::MmapRaw);

    // SAFETY: the mapping lives as long as the value, and the tests below never borrow it
    // while an I/O may touch it (they read it back through `bytes` only after the ring
    // returned or the queue reaped every write).
    unsafe impl RawBytes for Mem {
        fn as_mut_ptr(&self) -> *mut u8 {
            self.0.as_mut_ptr()
        }
        fn len(&self) -> usize {
            self.0.len()
        }
    }

    impl Mem {
        fn new(len: usize) -> Arc<Mem> {
            Arc::new(Mem(memmap2::MmapOptions::new()
                .len(len)
                .map_anon()
                .unwrap()
                .into()))
        }
        fn bytes(&self, at: usize, len: usize) -> Vec<u8> {
            // SAFETY: in bounds of the mapping, and no I/O is in flight (see `RawBytes` above).
            unsafe { std::slice::from_raw_parts(self.0.as_ptr().add(at), len) }.to_vec()
        }
        fn fill(&self, at: usize, len: usize, byte: u8) {
            // SAFETY: as in `bytes`.
            unsafe { std::ptr::write_bytes(self.0.as_mut_ptr().add(at), byte, len) }
        }
    }

    const PIECE: usize = 16 * ALIGN;

    #[test]
    fn reads_into_registered_pieces_are_fixed_and_the_rest_plain_and_all_land_bit_exact() {
        // Two and a half pieces; only the first two are "ready", so only they are registered.
        let mem = Mem::new(2 * PIECE + PIECE / 2);
        let f = temp_file("fixed-read");
        let data: Vec<u8> = (0..4 * PIECE).map(|i| (i * 7 + i / 4096) as u8).collect();
        std::os::unix::fs::FileExt::write_all_at(&f, &data, 0).unwrap();
        let mut ring = Ring::new(8).unwrap();
        ring.register_fixed(mem.clone(), PIECE).unwrap();
        assert_eq!(ring.extend_fixed(2 * PIECE + ALIGN).unwrap(), 2 * PIECE);
        // Idempotent: nothing further is ready.
        assert_eq!(ring.extend_fixed(2 * PIECE + ALIGN).unwrap(), 2 * PIECE);
        // (memory offset, file offset, length): in piece 0, in piece 1, across 0|1, in the
        // unregistered half piece.
        let reads = [
            (0, 0, PIECE - 2 * ALIGN),
            (PIECE + 2 * ALIGN, PIECE, 2 * ALIGN),
            (PIECE - ALIGN, 2 * PIECE, 2 * ALIGN),
            (2 * PIECE, 3 * PIECE, PIECE / 2),
        ];
        let mut ops: Vec<Op<'_>> = reads
            .iter()
            .map(|&(at, offset, len)| Op {
                fd: f.as_fd(),
                offset: offset as u64,
                buf: Buf::ReadRaw {
                    target: &*mem,
                    at,
                    len,
                },
                lane: 0,
            })
            .collect();
        assert!(ring.run(&mut ops, 4).iter().all(|r| r.is_ok()));
        assert_eq!(ring.take_op_counts(), OpCounts { fixed: 2, plain: 2 });
        assert_eq!(ring.take_op_counts(), OpCounts::default());
        drop(ops);
        for (at, offset, len) in reads {
            assert_eq!(mem.bytes(at, len), data[offset..offset + len], "at {at}");
        }
        // Once the rest is ready, the last (partial) piece is registered too.
        assert_eq!(ring.extend_fixed(mem.len()).unwrap(), mem.len());
        let err = ring.register_fixed(mem.clone(), PIECE).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
    }

    #[test]
    fn writes_from_registered_memory_are_fixed_and_read_back_bit_exact() {
        let mem = Mem::new(2 * PIECE);
        for p in 0..2 * PIECE / ALIGN {
            mem.fill(p * ALIGN, ALIGN, p as u8 + 1);
        }
        let f = temp_file("fixed-write");
        let mut q = WriteQueue::new(4, 2).unwrap();
        q.register_fixed(mem.clone(), PIECE).unwrap();
        assert_eq!(q.extend_fixed(PIECE).unwrap(), PIECE);
        assert_eq!(q.fixed_bytes(), PIECE);
        let src = Source::Raw(mem.clone());
        // Piece 0 (registered) in four writes, piece 1 (not registered) in one, and a header
        // from an aligned buffer.
        for i in 0..4 {
            let r = i * PIECE / 4..(i + 1) * PIECE / 4;
            q.push_from(f.as_fd(), r.start as u64, src.clone(), r, 0, 0)
                .unwrap();
        }
        q.push_from(f.as_fd(), PIECE as u64, src.clone(), PIECE..2 * PIECE, 0, 1)
            .unwrap();
        let head = Arc::new(crate::AlignedBuf::new(ALIGN).unwrap());
        q.push(f.as_fd(), 2 * PIECE as u64, &head, 0..ALIGN, 0, 2)
            .unwrap();
        let mut out = Vec::new();
        while q.pending() > 0 {
            q.poll(true, &mut out);
        }
        assert!(out.iter().all(|c| c.result.is_ok()));
        assert_eq!(q.take_op_counts(), OpCounts { fixed: 4, plain: 2 });
        let mut back = vec![0u8; 2 * PIECE];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut back, 0).unwrap();
        assert_eq!(back, mem.bytes(0, 2 * PIECE));
    }

    #[test]
    fn a_piece_over_the_kernels_limit_is_refused() {
        let ring = IoUring::new(2).unwrap();
        let err = Fixed::new(&ring, Mem::new(ALIGN), MAX_FIXED_PIECE_BYTES + 1).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }
}
