//! The L1 pool's backing memory: one anonymous mapping with hugepage advice, first-touched by
//! parallel threads so that every page is resident before a GPU driver pins it (registering an
//! unpopulated 8 GiB mapping took 16 s on an H200 host; populated first, 0.34 s, measured before
//! kvd was written; `kvd-bench populate` measures it again, benches/RESULTS.md).
//!
//! The pool's bytes are never borrowed as Rust slices. They are written and read only by raw
//! copies — CPU `memcpy` here and in the host backend, DMA by a GPU's copy engines — exactly like
//! device memory. Which bytes a copy may touch is decided by the server's page leases; this type
//! checks that every range lies inside the part of the mapping marked ready.
//!
//! A large pool is made ready in steps (ranges of whole pieces first-touched and pinned in
//! order, while the server already serves from the first ones): [`PoolMemory::mark_ready`]
//! records how far that has come, and copies refuse any byte beyond it, so that even a bug in
//! the page allocator could not make a GPU copy touch memory that is not pinned.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use memmap2::{Advice, MmapOptions, MmapRaw};

use crate::error::{check_range, GpuError};
use crate::layout::PoolLayout;

/// Bytes between two first-touch writes: the smallest page size on the platforms kvd runs on.
const TOUCH_STRIDE_BYTES: usize = 4096;

/// Anonymous host memory that backs the L1 pool.
#[derive(Debug)]
pub struct PoolMemory {
    map: MmapRaw,
    layout: PoolLayout,
    size_bytes: u64,
    hugepages: bool,
    /// Bytes from offset 0 that are populated and pinned (where a driver pins), so copies may
    /// use them.
    ready_bytes: AtomicU64,
}

/// Progress of a first-touch pass, reported every few seconds while it runs.
#[derive(Debug, Clone, Copy)]
pub struct TouchProgress {
    /// Bytes made resident so far.
    pub done_bytes: u64,
    /// Bytes to touch in all.
    pub total_bytes: u64,
    /// Time since the pass started.
    pub elapsed: Duration,
}

impl TouchProgress {
    /// Throughput so far in GB/s (10^9 bytes per second).
    pub fn gb_per_s(&self) -> f64 {
        let secs = self.elapsed.as_secs_f64();
        if secs == 0.0 {
            0.0
        } else {
            self.done_bytes as f64 / secs / 1e9
        }
    }

    /// Fraction done, 0.0..=1.0.
    pub fn fraction(&self) -> f64 {
        if self.total_bytes == 0 {
            1.0
        } else {
            self.done_bytes as f64 / self.total_bytes as f64
        }
    }
}

impl PoolMemory {
    /// Maps anonymous memory for `layout`. With `hugepages`, asks the kernel for transparent
    /// huge pages (a hint: where THP is off the mapping stays on 4 KiB pages and works the same).
    pub fn allocate(layout: PoolLayout, hugepages: bool) -> Result<Self, GpuError> {
        let size_bytes = layout.size_bytes();
        let len = usize::try_from(size_bytes)
            .map_err(|_| GpuError::Invalid(format!("pool size {size_bytes} overflows usize")))?;
        let map: MmapRaw = MmapOptions::new()
            .len(len)
            .map_anon()
            .map_err(|e| GpuError::io(format!("mapping {size_bytes} bytes for the L1 pool"), e))?
            .into();
        let mut advised = false;
        if hugepages {
            match map.advise(Advice::HugePage) {
                Ok(()) => advised = true,
                Err(e) => tracing::debug!("MADV_HUGEPAGE refused ({e}); the pool uses 4 KiB pages"),
            }
        }
        Ok(PoolMemory {
            map,
            layout,
            size_bytes,
            hugepages: advised,
            ready_bytes: AtomicU64::new(0),
        })
    }

    /// The layout the pool was mapped for: its size and pinned pieces.
    pub fn layout(&self) -> &PoolLayout {
        &self.layout
    }

    /// Size of the mapping in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Whether the kernel accepted the hugepage advice.
    pub fn hugepages(&self) -> bool {
        self.hugepages
    }

    /// Marks the first `bytes` of the pool ready for copies (populated, and pinned where a driver
    /// pins). Readiness only grows; a smaller value is ignored.
    pub fn mark_ready(&self, bytes: u64) {
        self.ready_bytes
            .fetch_max(bytes.min(self.size_bytes), Ordering::Release);
    }

    /// Bytes from offset 0 that copies may use.
    pub fn ready_bytes(&self) -> u64 {
        self.ready_bytes.load(Ordering::Acquire)
    }

    /// Asks the kernel to put the pages of `range` on NUMA node `node` when they are first
    /// touched (`mbind`, `MPOL_PREFERRED`: another node's memory when that one is full, rather
    /// than failing). Call before the range is first-touched; pages already resident stay
    /// where they are.
    pub fn prefer_node(&self, range: Range<u64>, node: u32) -> Result<(), GpuError> {
        const MASK_BITS: usize = 1024;
        let len = range.end.saturating_sub(range.start);
        check_range("L1 pool", range.start, len, self.size_bytes)?;
        if !range.start.is_multiple_of(TOUCH_STRIDE_BYTES as u64) || node as usize >= MASK_BITS {
            return Err(GpuError::Invalid(format!(
                "NUMA placement of pool bytes {range:?} on node {node}: the range must start on \
                 a page and the node be below {MASK_BITS}"
            )));
        }
        let mut mask = [0 as libc::c_ulong; MASK_BITS / libc::c_ulong::BITS as usize];
        let bits = libc::c_ulong::BITS as usize;
        mask[node as usize / bits] |= 1 << (node as usize % bits);
        let addr = self.map.as_mut_ptr() as usize + range.start as usize;
        // SAFETY: [addr, addr+len) lies inside this mapping (checked above; sizes fit in usize,
        // checked in `allocate`); mbind only sets the placement policy of those pages and reads
        // `mask`, which outlives the call. The kernel reads maxnode - 1 bits of it.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mbind,
                addr,
                len as usize,
                libc::MPOL_PREFERRED,
                mask.as_ptr(),
                MASK_BITS + 1,
                0u32,
            )
        };
        if r != 0 {
            return Err(GpuError::io(
                format!(
                    "placing pool bytes {range:?} on NUMA node {node} (mbind); start kvd on a \
                     kernel with NUMA support or report the node layout"
                ),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }

    /// Writes one byte in every page, from `threads` threads over disjoint ranges, so that the
    /// whole mapping is resident. Calls `progress` from the calling thread about every
    /// `report_every` while the threads run, and once at the end.
    pub fn first_touch(
        &self,
        threads: usize,
        report_every: Duration,
        progress: &mut dyn FnMut(TouchProgress),
    ) -> TouchProgress {
        self.first_touch_range(0..self.size_bytes, threads, report_every, progress)
    }

    /// Like [`PoolMemory::first_touch`], for the bytes `range` only (clamped to the mapping).
    pub fn first_touch_range(
        &self,
        range: Range<u64>,
        threads: usize,
        report_every: Duration,
        progress: &mut dyn FnMut(TouchProgress),
    ) -> TouchProgress {
        let threads = threads.max(1);
        let end = range.end.min(self.size_bytes);
        let begin = range.start.min(end);
        let total = end - begin;
        let done = AtomicU64::new(0);
        let start = Instant::now();
        // Both fit in usize: they are at most the mapping's length.
        let (first, len) = (begin as usize, total as usize);
        let per_thread = len.div_ceil(threads).next_multiple_of(TOUCH_STRIDE_BYTES);
        // Addresses travel to the threads as integers; each thread touches only its own range.
        let base = self.map.as_mut_ptr() as usize + first;
        std::thread::scope(|s| {
            let mut handles = Vec::with_capacity(threads);
            for t in 0..threads {
                let lo = (t * per_thread).min(len);
                let hi = ((t + 1) * per_thread).min(len);
                if lo == hi {
                    continue;
                }
                let done = &done;
                let handle = std::thread::Builder::new()
                    .name(format!("kvd-touch{t}"))
                    .spawn_scoped(s, move || touch_range(base, lo, hi, done))
                    .expect("spawning a first-touch thread");
                handles.push(handle);
            }
            let mut next_report = start + report_every;
            while handles.iter().any(|h| !h.is_finished()) {
                std::thread::sleep(report_every.min(Duration::from_millis(20)));
                if Instant::now() >= next_report {
                    next_report += report_every;
                    progress(TouchProgress {
                        done_bytes: done.load(Ordering::Relaxed),
                        total_bytes: total,
                        elapsed: start.elapsed(),
                    });
                }
            }
        });
        let last = TouchProgress {
            done_bytes: done.load(Ordering::Relaxed),
            total_bytes: total,
            elapsed: start.elapsed(),
        };
        progress(last);
        last
    }

    /// Start of the mapping, for a driver that registers it (pins it) as a whole.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn base_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }

    /// Pointer to `len` bytes at `offset`, checked against the ready part of the mapping.
    pub(crate) fn ptr_at(&self, offset: u64, len: u64) -> Result<*mut u8, GpuError> {
        check_range("L1 pool (ready part)", offset, len, self.ready_bytes())?;
        // SAFETY: offset + len <= ready_bytes <= size_bytes (checked above and in `mark_ready`)
        // and size_bytes fits in usize (checked in `allocate`), so the result stays inside the
        // mapping.
        Ok(unsafe { self.map.as_mut_ptr().add(offset as usize) })
    }

    /// Copies `src` into the pool at `offset` with the CPU: how chunks fetched from L2 or a disk
    /// land in their pages (GPU copies go through a copy engine instead).
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        let dst = self.ptr_at(offset, src.len() as u64)?;
        // SAFETY: `dst` has room for src.len() bytes (ptr_at checked it); `src` is a borrowed
        // slice, so it cannot overlap the pool, whose bytes are never borrowed.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies pool bytes at `offset` into `dst` with the CPU: how chunks leave for L2 or a disk.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        let src = self.ptr_at(offset, dst.len() as u64)?;
        // SAFETY: `src` has dst.len() readable bytes (ptr_at checked it); `dst` is an exclusive
        // borrow of other memory, so the two cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

/// `len` bytes of the pool's ready part, lent to the kernel for a disk read (io_uring, like a
/// GPU's DMA, writes them without a Rust borrow). Which page a read may fill is decided by the
/// server's page leases, as for every copy into the pool.
#[derive(Debug)]
pub struct PoolSpan<'a> {
    _pool: std::marker::PhantomData<&'a PoolMemory>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a span is a pointer into the pool's mapping plus a borrow of the pool that owns it;
// the pool is Sync and the pointer is only handed to the kernel.
unsafe impl Sync for PoolSpan<'_> {}

// SAFETY: `ptr..ptr+len` lies inside the ready part of the mapping (`PoolMemory::span` checked
// it), the mapping lives as long as the pool, which the span borrows, and the pool's bytes are
// never borrowed as Rust slices (module header), so no reference covers them.
unsafe impl kvd_uring::RawBytes for PoolSpan<'_> {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

// SAFETY: the whole mapping (`size_bytes`, which fits in usize: checked in `allocate`) is
// mapped and writable for as long as the pool lives, and its bytes are never borrowed as Rust
// slices (module header). This is how the disk tier registers the pool with io_uring as fixed
// buffers: it registers only the ready part (registering pins, so populates, every page), and
// which page an I/O may touch is decided by the server's page leases, as for a GPU's DMA.
unsafe impl kvd_uring::RawBytes for PoolMemory {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.size_bytes as usize
    }
}

/// As [`PoolSpan`], owning a reference to the pool: for a disk write straight from an L1 page
/// that outlives the call that starts it (its owner keeps the page unchanged until then).
#[derive(Debug)]
pub struct PoolPage {
    _pool: std::sync::Arc<PoolMemory>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: as for `PoolSpan`: a pointer into a mapping that the held Arc keeps alive; the pool
// is Send and Sync, and the pointer is only handed to the kernel.
unsafe impl Send for PoolPage {}
// SAFETY: as above.
unsafe impl Sync for PoolPage {}

// SAFETY: `ptr..ptr+len` lies inside the ready part of the mapping (`PoolMemory::page` checked
// it), which lives as long as the Arc held here, and the pool's bytes are never borrowed as
// Rust slices (module header).
unsafe impl kvd_uring::RawBytes for PoolPage {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

impl PoolMemory {
    /// The pool bytes at `offset..offset+len`, held by an Arc of the pool.
    pub fn page(self: &std::sync::Arc<Self>, offset: u64, len: u64) -> Result<PoolPage, GpuError> {
        Ok(PoolPage {
            _pool: self.clone(),
            ptr: self.ptr_at(offset, len)?,
            len: len as usize,
        })
    }
}

impl PoolMemory {
    /// The pool bytes at `offset..offset+len`, for a disk read straight into an L1 page.
    pub fn span(&self, offset: u64, len: u64) -> Result<PoolSpan<'_>, GpuError> {
        Ok(PoolSpan {
            _pool: std::marker::PhantomData,
            ptr: self.ptr_at(offset, len)?,
            len: len as usize,
        })
    }

    /// xxh3-64 of the pool bytes at `offset..offset+len`: the disk tier checks a value read
    /// straight into its page before the page becomes visible to lookups.
    pub fn xxh3(&self, offset: u64, len: u64) -> Result<u64, GpuError> {
        let src = self.ptr_at(offset, len)?;
        // SAFETY: `src..src+len` is readable (ptr_at checked it against the ready part); the
        // slice lives only for this call, while — by the server's page lease — nothing copies
        // into the page being checked (it is still being filled, invisible to lookups).
        let bytes = unsafe { std::slice::from_raw_parts(src, len as usize) };
        Ok(xxhash_rust::xxh3::xxh3_64(bytes))
    }
}

fn touch_range(base: usize, lo: usize, hi: usize, done: &AtomicU64) {
    const REPORT_BYTES: usize = 64 << 20;
    let mut since_report = 0usize;
    let mut at = lo;
    while at < hi {
        // SAFETY: base + hi lies inside the mapping (the caller clamps its range to it) and
        // lo <= at < hi; only this thread writes [lo, hi), and no copy reads it yet: the range is
        // not marked ready before the touch returns.
        unsafe { ((base + at) as *mut u8).write_volatile(0) };
        since_report += TOUCH_STRIDE_BYTES.min(hi - at);
        at += TOUCH_STRIDE_BYTES;
        if since_report >= REPORT_BYTES {
            done.fetch_add(since_report as u64, Ordering::Relaxed);
            since_report = 0;
        }
    }
    done.fetch_add(since_report as u64, Ordering::Relaxed);
}

// SAFETY: the mapping is owned by this value for its whole life and never borrowed as a slice;
// all access goes through bounds-checked raw copies (see the module header), so sharing the
// handle between threads cannot create aliasing references.
unsafe impl Sync for PoolMemory {}
// SAFETY: as above; the mapping is not tied to the creating thread.
unsafe impl Send for PoolMemory {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_touch_counts_every_byte_and_reports() {
        let mem =
            PoolMemory::allocate(PoolLayout::new(9 * 1024 * 1024 + 4096, 4096).unwrap(), true)
                .unwrap();
        let mut calls = 0;
        let last = mem.first_touch(3, Duration::from_millis(10), &mut |_| calls += 1);
        assert_eq!(last.done_bytes, mem.size_bytes());
        assert!(calls >= 1);
        assert!((last.fraction() - 1.0).abs() < 1e-9);
    }

    #[test]
    fn write_then_read_round_trips_and_bounds_are_checked() {
        let mem = PoolMemory::allocate(PoolLayout::new(1 << 20, 1 << 16).unwrap(), false).unwrap();
        mem.mark_ready(1 << 20);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        mem.write(12345, &data).unwrap();
        let mut back = vec![0u8; data.len()];
        mem.read(12345, &mut back).unwrap();
        assert_eq!(back, data);
        assert!(mem.write((1 << 20) - 10, &data).is_err());
        assert!(mem.read(u64::MAX - 1, &mut back).is_err());
    }

    #[test]
    fn bytes_beyond_the_ready_part_are_refused() {
        let layout = PoolLayout::new(4 << 16, 1 << 16).unwrap();
        let mem = PoolMemory::allocate(layout, false).unwrap();
        let data = [7u8; 16];
        assert!(mem.write(0, &data).is_err(), "nothing is ready yet");
        let touched =
            mem.first_touch_range(layout.pieces_range(0..1), 2, Duration::ZERO, &mut |_| {});
        assert_eq!(touched.done_bytes, 1 << 16);
        mem.mark_ready(layout.pieces_range(0..1).end);
        mem.write((1 << 16) - 16, &data).unwrap();
        assert!(
            mem.write((1 << 16) - 8, &data).is_err(),
            "crosses into piece 1"
        );
        mem.mark_ready(1);
        assert_eq!(mem.ready_bytes(), 1 << 16, "readiness never shrinks");
        mem.mark_ready(u64::MAX);
        assert_eq!(mem.ready_bytes(), 4 << 16, "and never passes the mapping");
    }

    #[test]
    fn a_range_can_be_placed_on_a_node_before_it_is_touched() {
        let layout = PoolLayout::new(4 << 21, 1 << 21).unwrap();
        let mem = PoolMemory::allocate(layout, false).unwrap();
        // Node 0 exists on every Linux machine.
        mem.prefer_node(layout.piece_range(1), 0).unwrap();
        // <linux/mempolicy.h>: return the policy of the page at the given address.
        const MPOL_F_ADDR: libc::c_ulong = 1 << 1;
        let mut mode: libc::c_int = -1;
        let addr = mem.base_ptr() as usize + (1 << 21);
        // SAFETY: MPOL_F_ADDR asks for the policy of the page at `addr`, inside the mapping;
        // the kernel writes one int to `mode` and no node mask (null, maxnode 0).
        let r = unsafe {
            libc::syscall(
                libc::SYS_get_mempolicy,
                &mut mode as *mut libc::c_int,
                std::ptr::null_mut::<libc::c_ulong>(),
                0usize,
                addr,
                MPOL_F_ADDR,
            )
        };
        assert_eq!(r, 0, "{}", std::io::Error::last_os_error());
        assert_eq!(mode, libc::MPOL_PREFERRED);
        assert!(mem.prefer_node(layout.piece_range(0), 4000).is_err());
        assert!(
            mem.prefer_node(0..(5 << 21), 0).is_err(),
            "beyond the mapping"
        );
        assert!(mem.prefer_node(100..4196, 0).is_err(), "not page-aligned");
    }
}
