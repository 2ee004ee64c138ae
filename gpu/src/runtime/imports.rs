//! What a registration imported on one GPU: its allocations, however each was shared, and its
//! event ring. The copy engine takes these; dropping the last reference unmaps and destroys.

use std::sync::Arc;

use crate::error::GpuError;
use crate::runtime::api::Runtime;
use crate::runtime::ctx::DeviceCtx;
use crate::runtime::events::EventRing;
use crate::runtime::ipc::IpcRange;
use crate::runtime::vmm::VmmImport;

/// Client memory imported on a GPU, however it was shared.
#[derive(Debug)]
pub enum GpuMemory<R: Runtime> {
    /// A range of an allocation opened by legacy IPC handle.
    Ipc(IpcRange<R>),
    /// VMM chunks imported by descriptor and mapped into one range.
    Vmm(VmmImport<R>),
}

impl<R: Runtime> GpuMemory<R> {
    /// Device address of `offset` within the KV range, checked for `len` bytes.
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<u64, GpuError> {
        match self {
            GpuMemory::Ipc(r) => r.device_ptr(offset, len),
            GpuMemory::Vmm(v) => v.device_ptr(offset, len),
        }
    }

    pub(crate) fn device(&self) -> &Arc<DeviceCtx<R>> {
        match self {
            GpuMemory::Ipc(r) => r.device(),
            GpuMemory::Vmm(v) => v.device(),
        }
    }
}

/// A registration on a GPU: its imported allocations and event ring.
#[derive(Debug)]
pub struct GpuImports<R: Runtime> {
    /// The allocations, in registration order.
    pub memories: Vec<GpuMemory<R>>,
    /// Both sides' interprocess events, when the client sent any.
    pub events: Option<EventRing<R>>,
}
