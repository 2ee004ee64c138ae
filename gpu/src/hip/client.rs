//! The client side of HIP: what a vLLM worker on ROCm (through `kvd._native`) or a GPU test
//! does so that kvd can reach its KV cache — describe an allocation, export its IPC handle or
//! its VMM chunks, create and record interprocess events on the model's stream, and poll kvd's.
//! Nothing here allocates GPU memory, except [`DeviceBuffer`] and [`VmmBuffer`] for tests.
//!
//! HIP's runtime shares PyTorch's per-thread current device, so every call first makes the
//! allocation's device current, as PyTorch itself does around its own calls.

use std::ffi::c_void;

use super::driver::{self, api, check, destroy_event, release_failed, set_device, void_ptr, Event};
use super::sys;
pub use super::vmm::{export_chunks, fd_export_supported, vmm_chunks, ExportedChunk, VmmBuffer};
pub use crate::client::Pointer;
use crate::error::{check_range, GpuError};

fn attribute(ptr: u64, attr: sys::hipPointer_attribute) -> Result<i32, GpuError> {
    let api = api()?;
    let mut v: i32 = 0;
    // SAFETY: both attributes asked for here are 32-bit integers; out-pointer to a local.
    let r =
        unsafe { (api.hipPointerGetAttribute)((&mut v as *mut i32).cast(), attr, void_ptr(ptr)) };
    check("hipPointerGetAttribute", r)?;
    Ok(v)
}

/// Whether the allocation holding `base` is VMM memory. ROCm documents the legacy-IPC pointer
/// attribute as unsupported on AMD GPUs, so where the attribute is refused the answer comes from
/// `hipMemRetainAllocationHandle`, which succeeds only for VMM (`hipMemCreate`) memory.
fn is_vmm(base: u64) -> Result<bool, GpuError> {
    if let Ok(legacy) = attribute(base, sys::HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE) {
        return Ok(legacy == 0);
    }
    let api = api()?;
    let mut h: sys::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; `base` is a live device address.
    let r = unsafe { (api.hipMemRetainAllocationHandle)(&mut h, void_ptr(base)) };
    if r == sys::hipSuccess {
        super::vmm::release_handle(h);
        Ok(true)
    } else {
        Ok(false)
    }
}

/// Describes the allocation holding `ptr`.
pub fn describe(ptr: u64) -> Result<Pointer, GpuError> {
    driver::available()?;
    let ordinal = attribute(ptr, sys::HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL)?;
    set_device(ordinal)?;
    let api = api()?;
    let (mut base, mut size): (sys::hipDeviceptr_t, usize) = (std::ptr::null_mut(), 0);
    // SAFETY: out-pointers to locals; the device is current.
    check("hipMemGetAddressRange", unsafe {
        (api.hipMemGetAddressRange)(&mut base, &mut size, void_ptr(ptr))
    })?;
    let base = base as u64;
    let (uuid, _) = driver::device_identity(ordinal)?;
    Ok(Pointer {
        base,
        alloc_bytes: size as u64,
        offset: ptr - base,
        ordinal,
        uuid,
        legacy_ipc: !is_vmm(base)?,
    })
}

/// Exports the legacy IPC handle of an allocation base. VMM memory gets
/// [`GpuError::VmmMemory`], which names the allocator setting and the fix.
pub fn ipc_handle(p: &Pointer) -> Result<[u8; 64], GpuError> {
    if !p.legacy_ipc {
        return Err(GpuError::VmmMemory);
    }
    set_device(p.ordinal)?;
    let api = api()?;
    let mut h = sys::hipIpcMemHandle_t { reserved: [0; 64] };
    // SAFETY: out-pointer to a local; `base` is the start of a live allocation.
    check("hipIpcGetMemHandle", unsafe {
        (api.hipIpcGetMemHandle)(&mut h, void_ptr(p.base))
    })?;
    Ok(h.reserved.map(|b| b as u8))
}

/// Free and total memory of a device, in bytes.
pub fn mem_info(ordinal: i32) -> Result<(u64, u64), GpuError> {
    set_device(ordinal)?;
    let api = api()?;
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: out-pointers to locals.
    check("hipMemGetInfo", unsafe {
        (api.hipMemGetInfo)(&mut free, &mut total)
    })?;
    Ok((free as u64, total as u64))
}

/// UUID of device `ordinal` in this process's view.
pub fn device_uuid(ordinal: i32) -> Result<[u8; 16], GpuError> {
    driver::available()?;
    Ok(driver::device_identity(ordinal)?.0)
}

/// Events of one device, destroyed together when dropped.
#[derive(Debug)]
struct EventList {
    ordinal: i32,
    events: Vec<Event>,
    what: &'static str,
}

impl EventList {
    fn get(&self, slot: usize) -> Result<Event, GpuError> {
        let e = *self
            .events
            .get(slot)
            .ok_or_else(|| GpuError::Invalid(format!("no {} in slot {slot}", self.what)))?;
        set_device(self.ordinal)?;
        Ok(e)
    }
}

impl Drop for EventList {
    fn drop(&mut self) {
        if let Err(e) = set_device(self.ordinal) {
            return release_failed(self.what, e);
        }
        // Each event was created or opened by this list's owner and is destroyed once, here.
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
        set_device(ordinal)?;
        let mut me = ClientEvents {
            list: EventList {
                ordinal,
                events: Vec::with_capacity(n),
                what: "client event",
            },
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

    /// Records event `slot` on `stream` (a `hipStream_t` such as PyTorch's
    /// `torch.cuda.current_stream().cuda_stream` on ROCm; 0 for the null stream).
    pub fn record(&self, slot: usize, stream: u64) -> Result<(), GpuError> {
        let e = self.list.get(slot)?;
        let api = api()?;
        // SAFETY: `e` lives as long as `self`; the caller passes a stream of this device.
        check("hipEventRecord", unsafe {
            (api.hipEventRecord)(e.0, stream as usize as sys::hipStream_t)
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
        set_device(ordinal)?;
        let mut me = ServerEvents {
            list: EventList {
                ordinal,
                events: Vec::with_capacity(handles.len()),
                what: "kvd event",
            },
        };
        for h in handles {
            me.list.events.push(driver::open_ipc_event(h)?);
        }
        Ok(me)
    }

    /// Whether the copy announced on `slot` has completed (never blocks).
    pub fn query(&self, slot: u16) -> Result<bool, GpuError> {
        let e = self.list.get(slot as usize)?;
        let api = api()?;
        // SAFETY: `e` lives as long as `self`.
        match unsafe { (api.hipEventQuery)(e.0) } {
            sys::hipSuccess => Ok(true),
            sys::hipErrorNotReady => Ok(false),
            r => check("hipEventQuery", r).map(|_| false),
        }
    }

    /// Makes `stream` wait for the copy announced on `slot`, without blocking the host.
    pub fn stream_wait(&self, slot: u16, stream: u64) -> Result<(), GpuError> {
        let e = self.list.get(slot as usize)?;
        let api = api()?;
        // SAFETY: `e` lives as long as `self`; the caller passes a stream of this device.
        check("hipStreamWaitEvent", unsafe {
            (api.hipStreamWaitEvent)(stream as usize as sys::hipStream_t, e.0, 0)
        })
    }

    /// Blocks until the copy announced on `slot` has completed (for tests and shutdown).
    pub fn synchronize(&self, slot: u16) -> Result<(), GpuError> {
        let e = self.list.get(slot as usize)?;
        let api = api()?;
        // SAFETY: `e` lives as long as `self`.
        check("hipEventSynchronize", unsafe {
            (api.hipEventSynchronize)(e.0)
        })
    }
}

/// A synchronous copy between any two addresses the runtime knows (device or host), on device
/// `ordinal`.
pub(crate) fn copy_sync(ordinal: i32, dst: u64, src: u64, len: usize) -> Result<(), GpuError> {
    set_device(ordinal)?;
    let api = api()?;
    // SAFETY: callers pass ranges they bounds-checked against live allocations or borrows.
    check("hipMemcpy", unsafe {
        (api.hipMemcpy)(
            void_ptr(dst),
            src as usize as *const c_void,
            len,
            sys::hipMemcpyDefault,
        )
    })
}

/// A plain `hipMalloc` buffer: the stand-in for a KV cache in GPU tests and benchmarks.
#[derive(Debug)]
pub struct DeviceBuffer {
    ordinal: i32,
    ptr: u64,
    size_bytes: u64,
}

impl DeviceBuffer {
    /// Allocates `size_bytes` on device `ordinal`.
    pub fn alloc(ordinal: i32, size_bytes: u64) -> Result<Self, GpuError> {
        set_device(ordinal)?;
        let api = api()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device is current.
        check("hipMalloc", unsafe {
            (api.hipMalloc)(&mut p, size_bytes as usize)
        })?;
        Ok(DeviceBuffer {
            ordinal,
            ptr: p as u64,
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
        copy_sync(
            self.ordinal,
            self.ptr + offset,
            src.as_ptr() as u64,
            src.len(),
        )
    }

    /// Copies device bytes at `offset` into `dst` (synchronous).
    pub fn read(&self, offset: u64, dst: &mut [u8]) -> Result<(), GpuError> {
        check_range("device buffer", offset, dst.len() as u64, self.size_bytes)?;
        copy_sync(
            self.ordinal,
            dst.as_mut_ptr() as u64,
            self.ptr + offset,
            dst.len(),
        )
    }

    /// Fills `len` bytes at `offset` with `value` on `stream` (0: the null stream), without
    /// waiting.
    pub fn fill_async(
        &self,
        offset: u64,
        len: u64,
        value: u8,
        stream: u64,
    ) -> Result<(), GpuError> {
        check_range("device buffer", offset, len, self.size_bytes)?;
        set_device(self.ordinal)?;
        let api = api()?;
        // SAFETY: the range is inside the allocation; the stream belongs to this device.
        check("hipMemsetD8Async", unsafe {
            (api.hipMemsetD8Async)(
                void_ptr(self.ptr + offset),
                value,
                len as usize,
                stream as usize as sys::hipStream_t,
            )
        })
    }

    /// Waits for all work on the device (tests only).
    pub fn synchronize(&self) -> Result<(), GpuError> {
        set_device(self.ordinal)?;
        let api = api()?;
        // SAFETY: no arguments; the device is current.
        check("hipDeviceSynchronize", unsafe {
            (api.hipDeviceSynchronize)()
        })
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let r = set_device(self.ordinal)
            .and_then(|()| api())
            .and_then(|api| {
                // SAFETY: allocated in `alloc`, freed once.
                check("hipFree", unsafe { (api.hipFree)(void_ptr(self.ptr)) })
            });
        if let Err(e) = r {
            release_failed("a device buffer", e);
        }
    }
}
