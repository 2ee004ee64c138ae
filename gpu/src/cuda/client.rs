//! The client side of CUDA: what a vLLM worker (through `kvd._native`) or a GPU test does with
//! the driver so that kvd can reach its KV cache — describe an allocation, export its IPC handle
//! or learn that it is VMM memory, create and record interprocess events on the model's stream,
//! and poll kvd's. Nothing here allocates GPU memory, except [`DeviceBuffer`] for tests.
//!
//! Everything runs in the device's primary context, the one PyTorch uses, so events and
//! streams from both mix.

use cudarc::driver::sys;

use super::driver::{self, check, destroy_event, release_failed, Event, PrimaryContext};
pub use super::vmm::{export_chunks, fd_export_supported, vmm_chunks, ExportedChunk, VmmBuffer};
use crate::error::GpuError;

pub use crate::client::Pointer;

fn attribute(ptr: u64, attr: sys::CUpointer_attribute) -> Result<i32, GpuError> {
    let mut v: i32 = 0;
    // SAFETY: both attributes asked for here are 32-bit integers; out-pointer to a local.
    let r = unsafe { sys::cuPointerGetAttribute((&mut v as *mut i32).cast(), attr, ptr) };
    check("cuPointerGetAttribute", r)?;
    Ok(v)
}

/// A device's primary context made current on this thread.
fn context(ordinal: i32) -> Result<PrimaryContext, GpuError> {
    let ctx = PrimaryContext::retain(ordinal)?;
    ctx.make_current()?;
    Ok(ctx)
}

/// Describes the allocation holding `ptr`.
pub fn describe(ptr: u64) -> Result<Pointer, GpuError> {
    driver::available()?;
    let ordinal = attribute(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
    )?;
    let _ctx = context(ordinal)?;
    let legacy = attribute(
        ptr,
        sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
    )?;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    // SAFETY: out-pointers to locals; the device's context is current.
    check("cuMemGetAddressRange_v2", unsafe {
        sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
    })?;
    let (uuid, _) = driver::device_identity(ordinal)?;
    Ok(Pointer {
        base,
        alloc_bytes: size as u64,
        offset: ptr - base,
        ordinal,
        uuid,
        legacy_ipc: legacy != 0,
    })
}

/// Exports the legacy IPC handle of an allocation base. VMM memory gets
/// [`GpuError::VmmMemory`], which names the allocator setting and the fix.
pub fn ipc_handle(p: &Pointer) -> Result<[u8; 64], GpuError> {
    if !p.legacy_ipc {
        return Err(GpuError::VmmMemory);
    }
    let _ctx = context(p.ordinal)?;
    let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
    // SAFETY: out-pointer to a local; `base` is the start of a live allocation.
    check("cuIpcGetMemHandle", unsafe {
        sys::cuIpcGetMemHandle(&mut h, p.base)
    })?;
    Ok(h.reserved.map(|b| b as u8))
}

/// Free and total memory of a device, in bytes.
pub fn mem_info(ordinal: i32) -> Result<(u64, u64), GpuError> {
    let _ctx = context(ordinal)?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: out-pointers to locals; a context is current.
    check("cuMemGetInfo_v2", unsafe {
        sys::cuMemGetInfo_v2(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// UUID of device `ordinal` in this process's view.
pub fn device_uuid(ordinal: i32) -> Result<[u8; 16], GpuError> {
    driver::available()?;
    Ok(driver::device_identity(ordinal)?.0)
}

/// Events of one device's primary context, destroyed together when dropped.
#[derive(Debug)]
struct EventList {
    ctx: PrimaryContext,
    events: Vec<Event>,
    what: &'static str,
}

impl EventList {
    fn new(ordinal: i32, capacity: usize, what: &'static str) -> Result<Self, GpuError> {
        Ok(EventList {
            ctx: context(ordinal)?,
            events: Vec::with_capacity(capacity),
            what,
        })
    }

    /// The event in `slot`, with the context made current for using it.
    fn get(&self, slot: usize) -> Result<sys::CUevent, GpuError> {
        let Event(e) = *self
            .events
            .get(slot)
            .ok_or_else(|| GpuError::Invalid(format!("no {} in slot {slot}", self.what)))?;
        self.ctx.make_current()?;
        Ok(e)
    }
}

impl Drop for EventList {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            release_failed(self.what, e);
            return;
        }
        // Each event was created or opened by this list's owner and is destroyed (or, for an
        // opened one, released) once, here.
        for &e in &self.events {
            destroy_event(e, self.what);
        }
    }
}

/// The client's interprocess events: one is recorded on the model's stream after a forward
/// pass, and its slot sent with the store or retrieve.
#[derive(Debug)]
pub struct ClientEvents {
    list: EventList,
    handles: Vec<[u8; 64]>,
}

impl ClientEvents {
    /// Creates `n` interprocess events on device `ordinal`.
    pub fn new(ordinal: i32, n: usize) -> Result<Self, GpuError> {
        let mut me = ClientEvents {
            list: EventList::new(ordinal, n, "client event")?,
            handles: Vec::with_capacity(n),
        };
        for _ in 0..n {
            let (e, handle) = driver::create_ipc_event()?;
            me.list.events.push(e);
            me.handles.push(handle);
        }
        Ok(me)
    }

    /// IPC handles, in slot order, for the registration.
    pub fn handles(&self) -> &[[u8; 64]] {
        &self.handles
    }

    /// Records event `slot` on `stream` (a `CUstream` such as
    /// `torch.cuda.current_stream().cuda_stream`; 0 for the legacy default stream).
    pub fn record(&self, slot: usize, stream: u64) -> Result<(), GpuError> {
        let e = self.list.get(slot)?;
        // SAFETY: `e` lives as long as `self`; the caller passes a stream of this context.
        check("cuEventRecord", unsafe {
            sys::cuEventRecord(e, stream as sys::CUstream)
        })
    }
}

/// kvd's events as the client sees them: opened from the handles in the registration reply.
#[derive(Debug)]
pub struct ServerEvents {
    list: EventList,
}

impl ServerEvents {
    /// Opens kvd's events on device `ordinal`.
    pub fn open(ordinal: i32, handles: &[[u8; 64]]) -> Result<Self, GpuError> {
        let mut me = ServerEvents {
            list: EventList::new(ordinal, handles.len(), "kvd event")?,
        };
        for h in handles {
            me.list.events.push(driver::open_ipc_event(h)?);
        }
        Ok(me)
    }

    fn event(&self, slot: u16) -> Result<sys::CUevent, GpuError> {
        self.list.get(slot as usize)
    }

    /// Whether the copy announced on `slot` has completed (never blocks).
    pub fn query(&self, slot: u16) -> Result<bool, GpuError> {
        let e = self.event(slot)?;
        // SAFETY: `e` lives as long as `self`.
        match unsafe { sys::cuEventQuery(e) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|_| false),
        }
    }

    /// Makes `stream` wait for the copy announced on `slot`, without blocking the host.
    pub fn stream_wait(&self, slot: u16, stream: u64) -> Result<(), GpuError> {
        let e = self.event(slot)?;
        // SAFETY: `e` lives as long as `self`; the caller passes a stream of this context.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(stream as sys::CUstream, e, 0)
        })
    }

    /// Blocks until the copy announced on `slot` has completed (for tests and shutdown).
    pub fn synchronize(&self, slot: u16) -> Result<(), GpuError> {
        let e = self.event(slot)?;
        // SAFETY: `e` lives as long as `self`.
        check("cuEventSynchronize", unsafe { sys::cuEventSynchronize(e) })
    }
}

/// A plain `cuMemAlloc` buffer: the stand-in for a KV cache in GPU tests and benchmarks.
#[derive(Debug)]
pub struct DeviceBuffer {
    ctx: PrimaryContext,
    ptr: sys::CUdeviceptr,
    size_bytes: u64,
}

impl DeviceBuffer {
    /// Allocates `size_bytes` on device `ordinal`.
    pub fn alloc(ordinal: i32, size_bytes: u64) -> Result<Self, GpuError> {
        let ctx = context(ordinal)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the context is current.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, size_bytes as usize)
        })?;
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
        crate::error::check_range("device buffer", offset, src.len() as u64, self.size_bytes)?;
        self.ctx.make_current()?;
        // SAFETY: the range is inside the allocation; `src` is a live host slice.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(self.ptr + offset, src.as_ptr().cast(), src.len())
        })
    }

    /// Copies device bytes at `offset` into `dst` (synchronous).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        crate::error::check_range("device buffer", offset, dst.len() as u64, self.size_bytes)?;
        self.ctx.make_current()?;
        // SAFETY: the range is inside the allocation; `dst` is a live host slice.
        check("cuMemcpyDtoH_v2", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), self.ptr + offset, dst.len())
        })
    }

    /// Fills `len` bytes at `offset` with `value` on `stream` (0: the legacy default stream),
    /// without waiting.
    pub fn fill_async(
        &self,
        offset: u64,
        len: u64,
        value: u8,
        stream: u64,
    ) -> Result<(), GpuError> {
        crate::error::check_range("device buffer", offset, len, self.size_bytes)?;
        self.ctx.make_current()?;
        // SAFETY: the range is inside the allocation; the stream belongs to this context.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(
                self.ptr + offset,
                value,
                len as usize,
                stream as sys::CUstream,
            )
        })
    }

    /// Waits for all work on the device (tests only).
    pub fn synchronize(&self) -> Result<(), GpuError> {
        self.ctx.make_current()?;
        // SAFETY: a context is current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.make_current().is_err() {
            return;
        }
        // SAFETY: allocated in `alloc`, freed once.
        if let Err(e) = check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(self.ptr) }) {
            release_failed("a device buffer", e);
        }
    }
}
