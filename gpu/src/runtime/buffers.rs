//! GPU memory that stands in for a KV cache in GPU tests and benchmarks: a plain allocation
//! ([`DeviceBuffer`], `cuMemAlloc`/`hipMalloc`) and VMM memory made of physical chunks
//! ([`VmmBuffer`]), exportable by descriptor the way PyTorch's expandable segments and vLLM's
//! cumem allocator build theirs. Each holds its device usable while it lives.

use crate::error::{check_range, release_failed, GpuError};
use crate::runtime::api::Runtime;
use crate::runtime::client::current;
use crate::runtime::vmm::Mapping;

/// A plain device allocation.
#[derive(Debug)]
pub struct DeviceBuffer<R: Runtime> {
    ctx: R::Context,
    ptr: u64,
    size_bytes: u64,
}

impl<R: Runtime> DeviceBuffer<R> {
    /// Allocates `size_bytes` on device `ordinal`.
    pub fn alloc(ordinal: i32, size_bytes: u64) -> Result<Self, GpuError> {
        let ctx = current::<R>(ordinal)?;
        let ptr = R::mem_alloc(size_bytes)?;
        Ok(DeviceBuffer {
            ctx,
            ptr,
            size_bytes,
        })
    }

    /// Device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Copies `src` to the device at `offset` (synchronous).
    pub fn write(&self, offset: u64, src: &[u8]) -> Result<(), GpuError> {
        check_range("device buffer", offset, src.len() as u64, self.size_bytes)?;
        R::make_current(&self.ctx)?;
        // SAFETY: the range is inside the allocation, which lives as long as `self`.
        unsafe { R::copy_to_device(self.ptr + offset, src) }
    }

    /// Copies device bytes at `offset` into `dst` (synchronous).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        check_range("device buffer", offset, dst.len() as u64, self.size_bytes)?;
        R::make_current(&self.ctx)?;
        // SAFETY: as for `write`.
        unsafe { R::copy_from_device(dst, self.ptr + offset) }
    }

    /// Fills `len` bytes at `offset` with `value` on `stream` (0: the default stream), without
    /// waiting.
    pub fn fill_async(
        &self,
        offset: u64,
        len: u64,
        value: u8,
        stream: u64,
    ) -> Result<(), GpuError> {
        check_range("device buffer", offset, len, self.size_bytes)?;
        R::make_current(&self.ctx)?;
        // SAFETY: the range is inside the allocation; the stream belongs to this device.
        unsafe { R::memset_async(self.ptr + offset, value, len, R::stream_from_raw(stream)) }
    }

    /// Waits for all work on the device (tests only).
    pub fn synchronize(&self) -> Result<(), GpuError> {
        R::make_current(&self.ctx)?;
        R::synchronize()
    }
}

impl<R: Runtime> Drop for DeviceBuffer<R> {
    fn drop(&mut self) {
        let r = R::make_current(&self.ctx).and_then(|()| {
            // SAFETY: allocated in `alloc`, freed once.
            unsafe { R::mem_free(self.ptr) }
        });
        if let Err(e) = r {
            release_failed("a device buffer", e);
        }
    }
}

/// VMM memory made of physical chunks, exportable as POSIX descriptors.
#[derive(Debug)]
pub struct VmmBuffer<R: Runtime> {
    ctx: R::Context,
    map: Mapping<R>,
}

impl<R: Runtime> VmmBuffer<R> {
    /// Allocates `size_bytes` on device `ordinal` as one chunk (rounded up to the runtime's
    /// granularity).
    pub fn alloc(ordinal: i32, size_bytes: u64) -> Result<Self, GpuError> {
        Self::alloc_chunked(ordinal, size_bytes, size_bytes)
    }

    /// Allocates `size_bytes` as physical chunks of `chunk_bytes` (both rounded up to the
    /// granularity).
    pub fn alloc_chunked(
        ordinal: i32,
        size_bytes: u64,
        chunk_bytes: u64,
    ) -> Result<Self, GpuError> {
        let ctx = current::<R>(ordinal)?;
        let g = R::buffer_granularity(ordinal)?;
        let chunk = chunk_bytes.max(1).div_ceil(g) * g;
        let size = size_bytes.max(1).div_ceil(chunk) * chunk;
        let mut map = Mapping::<R>::reserve(size, g)?;
        for off in (0..size).step_by(chunk as usize) {
            let h = R::mem_create(chunk, ordinal)?;
            map.map_and_release(off, chunk, h)?;
        }
        map.set_access(ordinal)?;
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
        R::make_current(&self.ctx)?;
        // SAFETY: the range is mapped and accessible while `self` lives.
        unsafe { R::copy_to_device(self.map.ptr + offset, src) }
    }

    /// Copies device bytes at `offset` into `dst` (synchronous).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        check_range("VMM buffer", offset, dst.len() as u64, self.map.size)?;
        R::make_current(&self.ctx)?;
        // SAFETY: as for `write`.
        unsafe { R::copy_from_device(dst, self.map.ptr + offset) }
    }
}

impl<R: Runtime> Drop for VmmBuffer<R> {
    fn drop(&mut self) {
        // The mapping is unmapped after this, with the device current.
        if let Err(e) = R::make_current(&self.ctx) {
            release_failed("a VMM buffer", e);
        }
    }
}
