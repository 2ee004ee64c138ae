//! The host backend: a client's "device memory" is a sealed memfd it shares with kvd over a Unix
//! socket (SCM_RIGHTS), and a copy is a CPU `memcpy` between that mapping and the pool. It runs
//! the same server code as the CUDA backend — registration, geometry, pages, pins, copy threads —
//! so CI exercises every server path between real processes without a GPU.
//!
//! The memfd must carry `F_SEAL_SHRINK`: otherwise a client could truncate it under kvd's
//! mapping and kill kvd with SIGBUS on the next copy.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::{MemfdFlags, SealFlags};

use crate::copy::{Direction, Transfer};
use crate::error::{check_range, GpuError};
use crate::memory::PoolMemory;
use crate::types::{ImportSource, IPC_HANDLE_BYTES};

/// The host "device": there is one per kvd.
#[derive(Debug, Default)]
pub struct HostDevice;

/// A client memfd mapped into kvd.
#[derive(Debug)]
pub struct HostImported {
    map: MmapRaw,
    size_bytes: u64,
}

// SAFETY: the mapping is never borrowed as a slice; it is accessed only by bounds-checked raw
// copies on the device's copy threads, like device memory.
unsafe impl Send for HostImported {}
// SAFETY: as above.
unsafe impl Sync for HostImported {}

impl HostImported {
    /// Bytes that copies may address, from offset 0.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    fn ptr_at(&self, offset: u64, len: u64) -> Result<*mut u8, GpuError> {
        check_range("imported host memory", offset, len, self.size_bytes)?;
        // SAFETY: offset + len <= size_bytes <= the mapping's length (checked at import).
        Ok(unsafe { self.map.as_mut_ptr().add(offset as usize) })
    }
}

/// A registration on the host backend: its memfd mappings (it has no events).
#[derive(Debug)]
pub struct HostImports {
    /// The mappings, in registration order.
    pub memories: Vec<HostImported>,
}

fn map_shared(fd: BorrowedFd<'_>, size_bytes: u64, what: &str) -> Result<MmapRaw, GpuError> {
    let len = usize::try_from(size_bytes)
        .map_err(|_| GpuError::Invalid(format!("{what}: size {size_bytes} overflows usize")))?;
    MmapOptions::new()
        .len(len)
        .map_raw(&fd)
        .map_err(|e| GpuError::io(format!("mapping {what} ({size_bytes} bytes)"), e))
}

impl HostDevice {
    /// Maps a registration's memfds; a registration with events is refused.
    pub fn import(
        &self,
        sources: Vec<ImportSource>,
        client_events: &[[u8; IPC_HANDLE_BYTES]],
        _server_slots: usize,
    ) -> Result<HostImports, GpuError> {
        if !client_events.is_empty() {
            return Err(GpuError::Invalid(
                "the host backend has no interprocess events; send none".into(),
            ));
        }
        let memories = sources
            .into_iter()
            .map(import_one)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(HostImports { memories })
    }
}

fn import_one(source: ImportSource) -> Result<HostImported, GpuError> {
    let ImportSource::HostFd { fd, size_bytes } = source else {
        return Err(GpuError::Invalid(
            "the host backend imports only memfd memory; GPU memory needs a GPU backend".into(),
        ));
    };
    if size_bytes == 0 {
        return Err(GpuError::Invalid("host memory of size 0".into()));
    }
    let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|e| {
        GpuError::io(
            "reading the seals of a client memfd (is it a memfd made with MFD_ALLOW_SEALING?)",
            e.into(),
        )
    })?;
    if !seals.contains(SealFlags::SHRINK) {
        return Err(GpuError::Invalid(
            "client memfd is not sealed against shrinking; add F_SEAL_SHRINK before sharing \
             it (kvd's client library does this)"
                .into(),
        ));
    }
    let stat = rustix::fs::fstat(&fd)
        .map_err(|e| GpuError::io("reading the size of a client memfd", e.into()))?;
    let file_bytes = u64::try_from(stat.st_size).unwrap_or(0);
    if file_bytes < size_bytes {
        return Err(GpuError::Invalid(format!(
            "client memfd holds {file_bytes} bytes but the registration names {size_bytes}"
        )));
    }
    let map = map_shared(fd.as_fd(), size_bytes, "client memfd")?;
    Ok(HostImported { map, size_bytes })
}

/// Copies with the CPU, synchronously.
#[derive(Debug)]
pub struct HostCopyEngine {
    pool: Arc<PoolMemory>,
}

/// A host copy, finished before `submit` returned.
#[derive(Debug)]
pub struct HostCompletion;

impl HostCopyEngine {
    /// An engine copying between the pool and memfd mappings.
    pub fn new(pool: Arc<PoolMemory>) -> Self {
        HostCopyEngine { pool }
    }

    /// Performs `job` over `imports` (the job's own, matched by [`crate::CopyEngine`]).
    pub fn submit(
        &mut self,
        job: Transfer<'_>,
        imports: &HostImports,
    ) -> Result<HostCompletion, GpuError> {
        if job.wait_slot.is_some() {
            return Err(GpuError::Invalid(
                "the host backend has no events to wait on".into(),
            ));
        }
        // Check every run before moving a byte, so a bad job copies nothing.
        let mut ptrs = Vec::with_capacity(job.runs.len());
        for run in job.runs {
            let memory = imports.memories.get(run.memory as usize).ok_or_else(|| {
                GpuError::Invalid(format!("copy run names allocation {}", run.memory))
            })?;
            let dev = memory.ptr_at(run.device_offset_bytes, run.len_bytes)?;
            let pool = self.pool.ptr_at(run.pool_offset_bytes, run.len_bytes)?;
            ptrs.push((dev, pool, run.len_bytes as usize));
        }
        for (dev, pool, len) in ptrs {
            let (src, dst) = match job.direction {
                Direction::D2h => (dev as *const u8, pool),
                Direction::H2d => (pool as *const u8, dev),
            };
            // SAFETY: both ranges were bounds-checked above against mappings that `job` and
            // `self` keep alive; one is in the pool and the other in a client mapping, so they
            // cannot overlap; neither is borrowed as a Rust slice anywhere.
            unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
        }
        Ok(HostCompletion)
    }
}

/// Client side of the host backend: a sealed memfd mapped read-write, standing in for a GPU's
/// KV cache. Tests, benches and the Python package's CPU path use it.
#[derive(Debug)]
pub struct SharedMemory {
    fd: OwnedFd,
    map: MmapRaw,
    size_bytes: u64,
}

// SAFETY: as for `HostImported`: the mapping is reached only through bounds-checked raw copies.
unsafe impl Send for SharedMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedMemory {}

impl SharedMemory {
    /// Creates a memfd of `size_bytes`, seals it against shrinking and growing, and maps it.
    pub fn create(name: &str, size_bytes: u64) -> Result<Self, GpuError> {
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(|e| GpuError::io("memfd_create", e.into()))?;
        rustix::fs::ftruncate(&fd, size_bytes)
            .map_err(|e| GpuError::io(format!("sizing a memfd to {size_bytes} bytes"), e.into()))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(|e| GpuError::io("sealing a memfd", e.into()))?;
        let map = map_shared(fd.as_fd(), size_bytes, "memfd")?;
        Ok(SharedMemory {
            fd,
            map,
            size_bytes,
        })
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// The descriptor to share with kvd.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Address of the mapping in this process, as a number (for clients that describe their
    /// cache by addresses, as they do for GPU memory).
    pub fn address(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    fn ptr_at(&self, offset: u64, len: u64) -> Result<*mut u8, GpuError> {
        check_range("shared memory", offset, len, self.size_bytes)?;
        // SAFETY: offset + len <= size_bytes, the mapping's length.
        Ok(unsafe { self.map.as_mut_ptr().add(offset as usize) })
    }

    /// Copies `src` in at `offset`.
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        let dst = self.ptr_at(offset, src.len() as u64)?;
        // SAFETY: room checked by ptr_at; `src` is a borrow of other memory.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copies bytes at `offset` out into `dst`.
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        let src = self.ptr_at(offset, dst.len() as u64)?;
        // SAFETY: range checked by ptr_at; `dst` is an exclusive borrow of other memory.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Reads `len` bytes at `offset` into a new vector.
    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, GpuError> {
        let mut v = vec![0u8; len];
        self.read(offset, &mut v)?;
        Ok(v)
    }
}
