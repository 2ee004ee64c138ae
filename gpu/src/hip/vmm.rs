//! HIP VMM memory (`hipMemCreate`: PyTorch's `expandable_segments:True` on ROCm), which legacy
//! IPC cannot share. As on CUDA, the client walks the physical chunks behind its KV range and
//! exports each with `hipMemExportToShareableHandle(POSIX_FD)`; kvd imports each descriptor
//! (`hipMemImportFromShareableHandle`), reserves one virtual range, maps the chunks at their
//! relative offsets and sets access. Only kvd's fd socket is shared between the processes.
//!
//! kvd's side never passes `hipMemAllocationProp` (whose layout changed in ROCm 6.0): the
//! reservation takes the runtime's default alignment, and the chunks' offsets and sizes come
//! from an allocation the runtime already made, so they are multiples of its granularity.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use super::device::DeviceInner;
use super::driver::{self, api, check, release_failed, set_device, void_ptr, DevicePtr};
use super::sys;
pub use crate::client::ExportedChunk;
use crate::error::{check_range, GpuError};

fn set_access(ptr: DevicePtr, size: u64, ordinal: i32) -> Result<(), GpuError> {
    let api = api()?;
    let desc = sys::hipMemAccessDesc {
        location: sys::hipMemLocation {
            type_: sys::hipMemLocationTypeDevice,
            id: ordinal,
        },
        flags: sys::hipMemAccessFlagsProtReadWrite,
    };
    // SAFETY: [ptr, ptr+size) is a reserved range whose every granule is mapped.
    check("hipMemSetAccess", unsafe {
        (api.hipMemSetAccess)(void_ptr(ptr), size as usize, &desc, 1)
    })
}

/// A reserved virtual range with physical chunks mapped into it; unmapped and freed on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    pub(crate) ptr: DevicePtr,
    pub(crate) size: u64,
    mapped: Vec<(u64, u64)>,
}

impl Mapping {
    pub(crate) fn reserve(size: u64, align: u64) -> Result<Self, GpuError> {
        let api = api()?;
        let mut ptr: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a device is current.
        check("hipMemAddressReserve", unsafe {
            (api.hipMemAddressReserve)(
                &mut ptr,
                size as usize,
                align as usize,
                std::ptr::null_mut(),
                0,
            )
        })?;
        Ok(Mapping {
            ptr: ptr as DevicePtr,
            size,
            mapped: Vec::new(),
        })
    }

    /// Maps a physical allocation of `size` bytes at `offset`. The caller may release the handle
    /// afterwards: the mapping keeps the memory alive.
    pub(crate) fn map(
        &mut self,
        offset: u64,
        size: u64,
        handle: sys::hipMemGenericAllocationHandle_t,
    ) -> Result<(), GpuError> {
        check_range("the reserved VMM range", offset, size, self.size)?;
        let api = api()?;
        // SAFETY: the target lies inside the reserved range and no other chunk was mapped there
        // (the caller checks offsets disjoint).
        check("hipMemMap", unsafe {
            (api.hipMemMap)(void_ptr(self.ptr + offset), size as usize, 0, handle, 0)
        })?;
        self.mapped.push((offset, size));
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let api = match api() {
            Ok(a) => a,
            Err(e) => return release_failed("a VMM mapping", e),
        };
        for &(off, size) in &self.mapped {
            // SAFETY: mapped by `map`, unmapped once.
            if let Err(e) = check("hipMemUnmap", unsafe {
                (api.hipMemUnmap)(void_ptr(self.ptr + off), size as usize)
            }) {
                release_failed("a VMM chunk mapping", e);
            }
        }
        // SAFETY: reserved by `reserve`, freed once after every mapping in it is gone.
        if let Err(e) = check("hipMemAddressFree", unsafe {
            (api.hipMemAddressFree)(void_ptr(self.ptr), self.size as usize)
        }) {
            release_failed("a VMM address range", e);
        }
    }
}

pub(crate) fn release_handle(h: sys::hipMemGenericAllocationHandle_t) {
    let r = api().and_then(|api| {
        // SAFETY: `h` came from hipMemCreate, hipMemRetainAllocationHandle or an import, and is
        // released once.
        check("hipMemRelease", unsafe { (api.hipMemRelease)(h) })
    });
    if let Err(e) = r {
        release_failed("a VMM allocation handle", e);
    }
}

/// kvd side: chunks imported from descriptors and mapped into one range.
#[derive(Debug)]
pub struct VmmImport {
    device: Arc<DeviceInner>,
    map: Option<Mapping>,
    range_offset: u64,
    size_bytes: u64,
}

impl VmmImport {
    /// Imports `chunks` (descriptor, offset from the first chunk, size) and maps them; the KV
    /// range starts `range_offset` bytes in and is `size_bytes` long.
    pub(crate) fn import(
        device: Arc<DeviceInner>,
        chunks: Vec<(OwnedFd, u64, u64)>,
        range_offset: u64,
        size_bytes: u64,
    ) -> Result<Self, GpuError> {
        device.make_current()?;
        let api = api()?;
        if chunks.is_empty() {
            return Err(GpuError::Invalid("VMM registration without chunks".into()));
        }
        let mut spans: Vec<(u64, u64)> = chunks.iter().map(|c| (c.1, c.2)).collect();
        spans.sort_unstable();
        if spans[0].0 != 0 || spans.windows(2).any(|w| w[0].0 + w[0].1 != w[1].0) {
            return Err(GpuError::Invalid(
                "VMM chunks must tile the range from offset 0 without gaps or overlaps".into(),
            ));
        }
        let total = spans.last().map(|s| s.0 + s.1).unwrap_or(0);
        check_range("the VMM chunks", range_offset, size_bytes, total)?;
        let mut map = Mapping::reserve(total, 0)?;
        for (fd, offset, size) in chunks {
            let mut h: sys::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
            // SAFETY: POSIX_FILE_DESCRIPTOR import takes the descriptor's value in the pointer
            // argument (CUDA's convention, which HIP follows); the descriptor stays open for the
            // call and is closed after it.
            let r = unsafe {
                (api.hipMemImportFromShareableHandle)(
                    &mut h,
                    fd.as_raw_fd() as isize as *mut std::ffi::c_void,
                    sys::hipMemHandleTypePosixFileDescriptor,
                )
            };
            check("hipMemImportFromShareableHandle", r)?;
            drop(fd);
            let mapped = map.map(offset, size, h);
            release_handle(h);
            mapped?;
        }
        set_access(map.ptr, total, device.ordinal)?;
        Ok(VmmImport {
            device,
            map: Some(map),
            range_offset,
            size_bytes,
        })
    }

    /// Device address of `offset` within the KV range, checked for `len` bytes.
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<DevicePtr, GpuError> {
        check_range("imported VMM memory", offset, len, self.size_bytes)?;
        let map = self
            .map
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("unmapped".into()))?;
        Ok(map.ptr + self.range_offset + offset)
    }

    pub(crate) fn device(&self) -> &Arc<DeviceInner> {
        &self.device
    }
}

impl Drop for VmmImport {
    fn drop(&mut self) {
        if let Err(e) = self.device.make_current() {
            release_failed("an imported VMM range", e);
            std::mem::forget(self.map.take());
            return;
        }
        self.map.take();
        tracing::debug!(device = %self.device.label, "released an imported VMM range");
    }
}

/// The physical chunks that back `[ptr, ptr + size)`, as (chunk base, chunk size), in address
/// order. Each mapped chunk is its own address range to the runtime.
pub fn vmm_chunks(ordinal: i32, ptr: u64, size: u64) -> Result<Vec<(u64, u64)>, GpuError> {
    set_device(ordinal)?;
    let api = api()?;
    let end = ptr
        .checked_add(size)
        .ok_or_else(|| GpuError::Invalid("range overflows".into()))?;
    let mut out = Vec::new();
    let mut at = ptr;
    while at < end {
        let (mut base, mut len): (sys::hipDeviceptr_t, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: out-pointers to locals; `at` lies inside the caller's mapped range.
        check("hipMemGetAddressRange", unsafe {
            (api.hipMemGetAddressRange)(&mut base, &mut len, void_ptr(at))
        })?;
        let base = base as DevicePtr;
        if len == 0 || base + len as u64 <= at {
            return Err(GpuError::Invalid(format!(
                "the runtime reports an empty range at {at:#x}"
            )));
        }
        out.push((base, len as u64));
        at = base + len as u64;
    }
    Ok(out)
}

/// Exports the chunks in `chunks` (from [`vmm_chunks`]) as POSIX descriptors, in batches the
/// caller chooses so that it never holds more descriptors than RLIMIT_NOFILE allows.
pub fn export_chunks(
    ordinal: i32,
    chunks: &[(u64, u64)],
    first_base: u64,
) -> Result<Vec<ExportedChunk>, GpuError> {
    set_device(ordinal)?;
    let api = api()?;
    let mut out = Vec::with_capacity(chunks.len());
    for &(base, size) in chunks {
        let mut h: sys::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: `base` is the start of a mapped VMM chunk; out-pointer to a local.
        check("hipMemRetainAllocationHandle", unsafe {
            (api.hipMemRetainAllocationHandle)(&mut h, void_ptr(base))
        })?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: out-pointer to a local int, as POSIX_FILE_DESCRIPTOR export requires.
        let r = unsafe {
            (api.hipMemExportToShareableHandle)(
                (&mut fd as *mut std::ffi::c_int).cast(),
                h,
                sys::hipMemHandleTypePosixFileDescriptor,
                0,
            )
        };
        release_handle(h);
        check("hipMemExportToShareableHandle", r).map_err(|e| match e {
            GpuError::Driver {
                call,
                name,
                message,
                ..
            } => GpuError::Driver {
                call,
                name,
                message,
                hint: "; this VMM memory was allocated without an exportable handle type: run \
                       vLLM with PyTorch's expandable_segments:True instead, or without its \
                       cumem allocator"
                    .into(),
            },
            other => other,
        })?;
        // SAFETY: the runtime returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        out.push(ExportedChunk {
            fd,
            offset_bytes: base - first_base,
            size_bytes: size,
        });
    }
    Ok(out)
}

/// Client side: VMM memory made of physical chunks, exportable as POSIX descriptors, the way
/// PyTorch's expandable segments build theirs. For tests and benchmarks.
#[derive(Debug)]
pub struct VmmBuffer {
    ordinal: i32,
    map: Mapping,
}

/// Granularity asked of the runtime for test buffers: 2 MiB, a multiple of every GPU's minimum.
const TEST_GRANULARITY_BYTES: u64 = 2 << 20;

impl VmmBuffer {
    /// Allocates `size_bytes` as physical chunks of `chunk_bytes` (both rounded up to 2 MiB).
    pub fn alloc_chunked(
        ordinal: i32,
        size_bytes: u64,
        chunk_bytes: u64,
    ) -> Result<Self, GpuError> {
        set_device(ordinal)?;
        let api = api()?;
        let g = TEST_GRANULARITY_BYTES;
        let chunk = chunk_bytes.max(1).div_ceil(g) * g;
        let size = size_bytes.max(1).div_ceil(chunk) * chunk;
        let mut map = Mapping::reserve(size, g)?;
        let prop = sys::hipMemAllocationProp {
            type_: sys::hipMemAllocationTypePinned,
            requestedHandleType: sys::hipMemHandleTypePosixFileDescriptor,
            location: sys::hipMemLocation {
                type_: sys::hipMemLocationTypeDevice,
                id: ordinal,
            },
            win32HandleMetaData: std::ptr::null_mut(),
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
        };
        for off in (0..size).step_by(chunk as usize) {
            let mut h: sys::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
            // SAFETY: out-pointer to a local; `prop` is a valid property struct.
            check("hipMemCreate", unsafe {
                (api.hipMemCreate)(&mut h, chunk as usize, &prop, 0)
            })?;
            let mapped = map.map(off, chunk, h);
            release_handle(h);
            mapped?;
        }
        set_access(map.ptr, size, ordinal)?;
        Ok(VmmBuffer { ordinal, map })
    }

    /// Allocates `size_bytes` (rounded up to 2 MiB) as one chunk.
    pub fn alloc(ordinal: i32, size_bytes: u64) -> Result<Self, GpuError> {
        Self::alloc_chunked(ordinal, size_bytes, size_bytes)
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.map.ptr
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.map.size
    }

    /// Copies `src` to the device at `offset` (synchronous).
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        check_range("VMM buffer", offset, src.len() as u64, self.map.size)?;
        super::client::copy_sync(
            self.ordinal,
            self.map.ptr + offset,
            src.as_ptr() as u64,
            src.len(),
        )
    }

    /// Copies device bytes at `offset` into `dst` (synchronous).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        check_range("VMM buffer", offset, dst.len() as u64, self.map.size)?;
        super::client::copy_sync(
            self.ordinal,
            dst.as_mut_ptr() as u64,
            self.map.ptr + offset,
            dst.len(),
        )
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        if let Err(e) = set_device(self.ordinal) {
            release_failed("a VMM buffer", e);
        }
    }
}

/// Whether the runtime can share VMM memory by descriptor here.
pub fn fd_export_supported() -> bool {
    driver::available().is_ok()
}
