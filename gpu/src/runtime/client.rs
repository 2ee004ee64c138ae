//! The client side of a GPU runtime: what a vLLM worker (through `kvd._native`) or a GPU test
//! does so that kvd can reach its KV cache — describe an allocation, export its IPC handle or its
//! VMM chunks, create and record interprocess events on the model's stream, and poll kvd's.
//! Nothing here allocates GPU memory ([`super::buffers`] does, for tests).
//!
//! Every call first makes the allocation's device current: on CUDA that is its primary context,
//! the one PyTorch uses, so events and streams from both mix; HIP's runtime shares PyTorch's
//! per-thread current device, which PyTorch itself sets around its own calls.

use std::os::fd::OwnedFd;

use crate::error::{release_failed, GpuError};
use crate::runtime::api::Runtime;
use crate::runtime::ctx::{destroy_event, release_handle};
use crate::types::IPC_HANDLE_BYTES;

/// What the runtime says about a device pointer.
#[derive(Debug, Clone)]
pub struct Pointer {
    /// Base of the allocation that holds the pointer (`cuMemGetAddressRange`/HIP's).
    pub base: u64,
    /// Size of that allocation.
    pub alloc_bytes: u64,
    /// Offset of the pointer from the base.
    pub offset: u64,
    /// Device ordinal in this process's view.
    pub ordinal: i32,
    /// Device UUID, the same in every process.
    pub uuid: [u8; 16],
    /// Whether legacy IPC can export it (false for VMM memory).
    pub legacy_ipc: bool,
}

/// One exported physical chunk of VMM memory.
#[derive(Debug)]
pub struct ExportedChunk {
    /// The chunk's descriptor.
    pub fd: OwnedFd,
    /// Offset of the chunk's first byte from the first chunk's first byte.
    pub offset_bytes: u64,
    /// Size of the chunk.
    pub size_bytes: u64,
}

/// Device `ordinal` made current on this thread, kept usable while the value lives.
pub(crate) fn current<R: Runtime>(ordinal: i32) -> Result<R::Context, GpuError> {
    let ctx = R::retain(ordinal)?;
    R::make_current(&ctx)?;
    Ok(ctx)
}

/// Describes the allocation holding `ptr`.
pub fn describe<R: Runtime>(ptr: u64) -> Result<Pointer, GpuError> {
    R::available()?;
    let ordinal = R::pointer_ordinal(ptr)?;
    let _ctx = current::<R>(ordinal)?;
    let (base, size) = R::address_range(ptr)?;
    let (uuid, _) = R::device_identity(ordinal)?;
    Ok(Pointer {
        base,
        alloc_bytes: size,
        offset: ptr - base,
        ordinal,
        uuid,
        legacy_ipc: R::legacy_ipc_capable(ptr, base)?,
    })
}

/// Exports the legacy IPC handle of an allocation base. VMM memory gets
/// [`GpuError::VmmMemory`], which names the allocator setting and the fix.
pub fn ipc_handle<R: Runtime>(p: &Pointer) -> Result<[u8; IPC_HANDLE_BYTES], GpuError> {
    if !p.legacy_ipc {
        return Err(GpuError::VmmMemory);
    }
    let _ctx = current::<R>(p.ordinal)?;
    R::ipc_get_mem_handle(p.base)
}

/// Free and total memory of a device, in bytes.
pub fn mem_info<R: Runtime>(ordinal: i32) -> Result<(u64, u64), GpuError> {
    let _ctx = current::<R>(ordinal)?;
    R::mem_info()
}

/// The physical chunks that back `[ptr, ptr + size)`, as (chunk base, chunk size), in address
/// order. Each mapped chunk is its own address range to the runtime.
pub fn vmm_chunks<R: Runtime>(
    ordinal: i32,
    ptr: u64,
    size: u64,
) -> Result<Vec<(u64, u64)>, GpuError> {
    let _ctx = current::<R>(ordinal)?;
    let end = ptr
        .checked_add(size)
        .ok_or_else(|| GpuError::Invalid("range overflows".into()))?;
    let mut out = Vec::new();
    let mut at = ptr;
    while at < end {
        let (base, len) = R::address_range(at)?;
        if len == 0 || base + len <= at {
            return Err(GpuError::Invalid(format!(
                "{} reports an empty range at {at:#x}",
                R::DRIVER
            )));
        }
        out.push((base, len));
        at = base + len;
    }
    Ok(out)
}

/// Exports the chunks in `chunks` (from [`vmm_chunks`]) as POSIX descriptors. Callers with
/// thousands of chunks export and send them in batches, so that they never hold more
/// descriptors than RLIMIT_NOFILE allows.
pub fn export_chunks<R: Runtime>(
    ordinal: i32,
    chunks: &[(u64, u64)],
    first_base: u64,
) -> Result<Vec<ExportedChunk>, GpuError> {
    let _ctx = current::<R>(ordinal)?;
    let mut out = Vec::with_capacity(chunks.len());
    for &(base, size) in chunks {
        let h = R::mem_retain_handle(base)?;
        // SAFETY: `h` was just retained and is released only below.
        let fd = unsafe { R::mem_export_fd(h) };
        release_handle::<R>(h);
        let fd = fd.map_err(|e| e.with_hint(R::EXPORT_FIX))?;
        out.push(ExportedChunk {
            fd,
            offset_bytes: base - first_base,
            size_bytes: size,
        });
    }
    Ok(out)
}

/// Events of one device, destroyed together when dropped.
#[derive(Debug)]
struct EventList<R: Runtime> {
    ctx: R::Context,
    events: Vec<R::Event>,
    what: &'static str,
}

impl<R: Runtime> EventList<R> {
    fn new(ordinal: i32, capacity: usize, what: &'static str) -> Result<Self, GpuError> {
        Ok(EventList {
            ctx: current::<R>(ordinal)?,
            events: Vec::with_capacity(capacity),
            what,
        })
    }

    /// The event in `slot`, with its device made current for using it.
    fn get(&self, slot: usize) -> Result<R::Event, GpuError> {
        let e = *self
            .events
            .get(slot)
            .ok_or_else(|| GpuError::Invalid(format!("no {} in slot {slot}", self.what)))?;
        R::make_current(&self.ctx)?;
        Ok(e)
    }
}

impl<R: Runtime> Drop for EventList<R> {
    fn drop(&mut self) {
        if let Err(e) = R::make_current(&self.ctx) {
            release_failed(self.what, e);
            return;
        }
        // Each event was created or opened by this list's owner and is destroyed (or, for an
        // opened one, released) once, here.
        for &e in &self.events {
            destroy_event::<R>(e, self.what);
        }
    }
}

/// The client's interprocess events: one is recorded on the model's stream after a forward
/// pass, and its slot sent with the store or retrieve.
#[derive(Debug)]
pub struct ClientEvents<R: Runtime> {
    list: EventList<R>,
    handles: Vec<[u8; IPC_HANDLE_BYTES]>,
}

impl<R: Runtime> ClientEvents<R> {
    /// Creates `n` interprocess events on device `ordinal`.
    pub fn new(ordinal: i32, n: usize) -> Result<Self, GpuError> {
        let mut me = ClientEvents {
            list: EventList::new(ordinal, n, "client event")?,
            handles: Vec::with_capacity(n),
        };
        for _ in 0..n {
            let (e, handle) = R::ipc_event_create()?;
            me.list.events.push(e);
            me.handles.push(handle);
        }
        Ok(me)
    }

    /// IPC handles, in slot order, for the registration.
    pub fn handles(&self) -> &[[u8; IPC_HANDLE_BYTES]] {
        &self.handles
    }

    /// Records event `slot` on `stream` (PyTorch's `torch.cuda.current_stream().cuda_stream`,
    /// on CUDA or ROCm; 0 for the default stream).
    pub fn record(&self, slot: usize, stream: u64) -> Result<(), GpuError> {
        let e = self.list.get(slot)?;
        // SAFETY: `e` lives as long as `self`; the caller passes a stream of this device.
        unsafe { R::event_record(e, R::stream_from_raw(stream)) }
    }
}

/// kvd's events as the client sees them: opened from the handles in the registration reply.
#[derive(Debug)]
pub struct ServerEvents<R: Runtime> {
    list: EventList<R>,
}

impl<R: Runtime> ServerEvents<R> {
    /// Opens kvd's events on device `ordinal`.
    pub fn open(ordinal: i32, handles: &[[u8; IPC_HANDLE_BYTES]]) -> Result<Self, GpuError> {
        let mut me = ServerEvents {
            list: EventList::new(ordinal, handles.len(), "kvd event")?,
        };
        for h in handles {
            me.list.events.push(R::ipc_event_open(h)?);
        }
        Ok(me)
    }

    /// Whether the copy announced on `slot` has completed (never blocks).
    pub fn query(&self, slot: u16) -> Result<bool, GpuError> {
        let e = self.list.get(slot as usize)?;
        // SAFETY: `e` lives as long as `self`.
        unsafe { R::event_query(e) }
    }

    /// Makes `stream` wait for the copy announced on `slot`, without blocking the host.
    pub fn stream_wait(&self, slot: u16, stream: u64) -> Result<(), GpuError> {
        let e = self.list.get(slot as usize)?;
        // SAFETY: `e` lives as long as `self`; the caller passes a stream of this device.
        unsafe { R::stream_wait_event(R::stream_from_raw(stream), e) }
    }

    /// Blocks until the copy announced on `slot` has completed (for tests and shutdown).
    pub fn synchronize(&self, slot: u16) -> Result<(), GpuError> {
        let e = self.list.get(slot as usize)?;
        // SAFETY: `e` lives as long as `self`.
        unsafe { R::event_synchronize(e) }
    }
}
