//! CUDA VMM memory — PyTorch's `expandable_segments:True`, vLLM's cumem allocator — which
//! legacy IPC cannot share (`IS_LEGACY_CUDA_IPC_CAPABLE = 0`, `cudaIpcGetMemHandle` fails with
//! `cudaErrorInvalidValue`). It can be shared by file descriptor instead: the client walks the
//! physical chunks that back its KV range and exports each with
//! `cuMemExportToShareableHandle(POSIX_FD)`; kvd imports each descriptor, reserves one virtual
//! range, maps the chunks at the same relative offsets and sets access.
//!
//! Only the fd socket path is shared between the processes: no `pidfd_getfd`, no shared PID
//! namespace, so kvd and vLLM may run in separate containers.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use cudarc::driver::sys;

use super::device::DeviceInner;
use super::driver::{self, check, release_failed, PrimaryContext};
pub use crate::client::ExportedChunk;
use crate::error::{check_range, GpuError};

fn device_location(ordinal: i32) -> sys::CUmemLocation {
    sys::CUmemLocation {
        type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
        id: ordinal,
    }
}

fn pinned_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: device_location(ordinal),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Allocation granularity of device `ordinal` for exportable pinned memory.
fn granularity(ordinal: i32) -> Result<u64, GpuError> {
    let prop = pinned_prop(ordinal);
    let mut g: usize = 0;
    // SAFETY: out-pointer to a local; `prop` is a valid property struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(g as u64)
}

fn set_access(ptr: sys::CUdeviceptr, size: u64, ordinal: i32) -> Result<(), GpuError> {
    let desc = sys::CUmemAccessDesc {
        location: device_location(ordinal),
        flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    // SAFETY: [ptr, ptr+size) is a reserved range whose every granule is mapped.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(ptr, size as usize, &desc, 1)
    })
}

/// A reserved virtual range with physical chunks mapped into it; unmapped and freed on drop.
#[derive(Debug)]
struct Mapping {
    ptr: sys::CUdeviceptr,
    size: u64,
    mapped: Vec<(u64, u64)>,
}

impl Mapping {
    fn reserve(size: u64, align: u64) -> Result<Self, GpuError> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; a context is current.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size as usize, align as usize, 0, 0)
        })?;
        Ok(Mapping {
            ptr,
            size,
            mapped: Vec::new(),
        })
    }

    /// Maps a physical allocation of `size` bytes at `offset`. The caller may release the handle
    /// afterwards: the mapping keeps the memory alive.
    fn map(
        &mut self,
        offset: u64,
        size: u64,
        handle: sys::CUmemGenericAllocationHandle,
    ) -> Result<(), GpuError> {
        check_range("the reserved VMM range", offset, size, self.size)?;
        // SAFETY: the target lies inside the reserved range and no other chunk was mapped there
        // (offsets are checked disjoint by the caller).
        check("cuMemMap", unsafe {
            sys::cuMemMap(self.ptr + offset, size as usize, 0, handle, 0)
        })?;
        self.mapped.push((offset, size));
        Ok(())
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        for &(off, size) in &self.mapped {
            // SAFETY: mapped by `map`, unmapped once.
            if let Err(e) = check("cuMemUnmap", unsafe {
                sys::cuMemUnmap(self.ptr + off, size as usize)
            }) {
                release_failed("a VMM chunk mapping", e);
            }
        }
        // SAFETY: reserved by `reserve`, freed once after every mapping in it is gone.
        if let Err(e) = check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(self.ptr, self.size as usize)
        }) {
            release_failed("a VMM address range", e);
        }
    }
}

fn release_handle(h: sys::CUmemGenericAllocationHandle) {
    // SAFETY: `h` came from cuMemCreate, cuMemRetainAllocationHandle or an import, and is
    // released once.
    if let Err(e) = check("cuMemRelease", unsafe { sys::cuMemRelease(h) }) {
        release_failed("a VMM allocation handle", e);
    }
}

/// Client side: VMM memory made of `chunk_bytes` physical chunks, the way PyTorch's expandable
/// segments and vLLM's cumem allocator build theirs. For tests and benchmarks.
#[derive(Debug)]
pub struct VmmBuffer {
    ctx: PrimaryContext,
    map: Mapping,
}

impl VmmBuffer {
    /// Allocates `size_bytes` (rounded up to the granularity) on device `ordinal` as one chunk.
    pub fn alloc(ordinal: i32, size_bytes: u64) -> Result<Self, GpuError> {
        Self::alloc_chunked(ordinal, size_bytes, size_bytes)
    }

    /// Allocates `size_bytes` as physical chunks of `chunk_bytes` (both rounded up to the
    /// granularity), exportable as POSIX file descriptors.
    pub fn alloc_chunked(
        ordinal: i32,
        size_bytes: u64,
        chunk_bytes: u64,
    ) -> Result<Self, GpuError> {
        let ctx = PrimaryContext::retain(ordinal)?;
        ctx.make_current()?;
        let g = granularity(ordinal)?;
        let chunk = chunk_bytes.max(1).div_ceil(g) * g;
        let size = size_bytes.max(1).div_ceil(chunk) * chunk;
        let mut map = Mapping::reserve(size, g)?;
        let prop = pinned_prop(ordinal);
        for off in (0..size).step_by(chunk as usize) {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: out-pointer to a local; a context is current.
            check("cuMemCreate", unsafe {
                sys::cuMemCreate(&mut h, chunk as usize, &prop, 0)
            })?;
            let mapped = map.map(off, chunk, h);
            release_handle(h);
            mapped?;
        }
        set_access(map.ptr, size, ordinal)?;
        Ok(VmmBuffer { ctx, map })
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
        self.ctx.make_current()?;
        // SAFETY: the range is mapped and accessible; `src` is a live host slice.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(self.map.ptr + offset, src.as_ptr().cast(), src.len())
        })
    }

    /// Copies device bytes at `offset` into `dst` (synchronous).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        check_range("VMM buffer", offset, dst.len() as u64, self.map.size)?;
        self.ctx.make_current()?;
        // SAFETY: the range is mapped and accessible; `dst` is a live host slice.
        check("cuMemcpyDtoH_v2", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.map.ptr + offset, dst.len())
        })
    }
}

impl Drop for VmmBuffer {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            release_failed("a VMM buffer", e);
        }
    }
}

/// VMM memory exported for kvd: chunks covering a KV range.
#[derive(Debug)]
pub struct VmmExport {
    /// Offset of the KV range from the first chunk's first byte.
    pub range_offset_bytes: u64,
    /// The chunks, in address order.
    pub chunks: Vec<ExportedChunk>,
}

/// The physical chunks that back `[ptr, ptr + size)`, as (chunk base, chunk size), in address
/// order. Each mapped chunk is its own address range to the driver.
pub fn vmm_chunks(ordinal: i32, ptr: u64, size: u64) -> Result<Vec<(u64, u64)>, GpuError> {
    let ctx = PrimaryContext::retain(ordinal)?;
    ctx.make_current()?;
    let end = ptr
        .checked_add(size)
        .ok_or_else(|| GpuError::Invalid("range overflows".into()))?;
    let mut out = Vec::new();
    let mut at = ptr;
    while at < end {
        let (mut base, mut len) = (0 as sys::CUdeviceptr, 0usize);
        // SAFETY: out-pointers to locals; `at` lies inside the caller's mapped range.
        check("cuMemGetAddressRange_v2", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut len, at)
        })?;
        if len == 0 || base + len as u64 <= at {
            return Err(GpuError::Invalid(format!(
                "the driver reports an empty range at {at:#x}"
            )));
        }
        out.push((base, len as u64));
        at = base + len as u64;
    }
    Ok(out)
}

/// Exports the chunks in `chunks` (from [`vmm_chunks`]) as POSIX descriptors. Callers with
/// thousands of chunks export and send them in batches, so that they never hold more
/// descriptors than RLIMIT_NOFILE allows.
pub fn export_chunks(
    ordinal: i32,
    chunks: &[(u64, u64)],
    first_base: u64,
) -> Result<Vec<ExportedChunk>, GpuError> {
    let ctx = PrimaryContext::retain(ordinal)?;
    ctx.make_current()?;
    let mut out = Vec::with_capacity(chunks.len());
    for &(base, size) in chunks {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: `base` is the start of a mapped VMM chunk; out-pointer to a local.
        check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&mut h, base as *mut std::ffi::c_void)
        })?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: out-pointer to a local int, as POSIX_FILE_DESCRIPTOR export requires.
        let r = unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        };
        release_handle(h);
        check("cuMemExportToShareableHandle", r).map_err(|e| match e {
            GpuError::Driver {
                call,
                name,
                message,
                ..
            } => GpuError::Driver {
                call,
                name,
                message,
                hint: "; this VMM memory was allocated without an exportable handle type (vLLM's \
                       cumem allocator does this): run vLLM with PyTorch's \
                       expandable_segments:True instead, or without the cumem allocator"
                    .into(),
            },
            other => other,
        })?;
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        out.push(ExportedChunk {
            fd,
            offset_bytes: base - first_base,
            size_bytes: size,
        });
    }
    Ok(out)
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
        device.ctx.make_current()?;
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
        let g = granularity(device.ordinal)?;
        if spans.iter().any(|s| s.0 % g != 0 || s.1 % g != 0) {
            return Err(GpuError::Invalid(format!(
                "VMM chunks must be multiples of the {g}-byte granularity"
            )));
        }
        let mut map = Mapping::reserve(total, g)?;
        for (fd, offset, size) in chunks {
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            // SAFETY: POSIX_FILE_DESCRIPTOR import takes the descriptor's value as the
            // "pointer"; the descriptor stays open for the call and is closed after it.
            let r = unsafe {
                sys::cuMemImportFromShareableHandle(
                    &mut h,
                    fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                )
            };
            check("cuMemImportFromShareableHandle", r)?;
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
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<sys::CUdeviceptr, GpuError> {
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
        if let Err(e) = self.device.ctx.make_current() {
            release_failed("an imported VMM range", e);
            std::mem::forget(self.map.take());
            return;
        }
        self.map.take();
        tracing::debug!(device = %self.device.label, "released an imported VMM range");
    }
}

/// Whether the driver can share VMM memory by descriptor here.
pub fn fd_export_supported() -> bool {
    driver::available().is_ok() && driver::has_symbol("cuMemExportToShareableHandle")
}
