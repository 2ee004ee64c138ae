//! The device abstraction the server programs against. A [`Device`] is one GPU (or, for the host
//! backend, the machine itself); it imports client memory and starts the one copy engine that the
//! server runs on that device's own thread. Backends: `host` (memfd memory shared by file
//! descriptor, so every server path runs in CI) and `cuda`.

use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::copy::CopyJob;
use crate::error::GpuError;
use crate::memory::PoolMemory;

/// Size of a CUDA IPC memory or event handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// Client memory to import, as the client described it.
#[derive(Debug)]
pub enum ImportSource {
    /// A sealed memfd holding the client's "device" memory (host backend).
    HostFd {
        /// The descriptor, received over kvd's fd socket.
        fd: OwnedFd,
        /// Bytes the client uses, from offset 0.
        size_bytes: u64,
    },
    /// CUDA VMM memory shared as one descriptor per physical chunk.
    CudaVmm {
        /// (descriptor, offset of the chunk from the first chunk, chunk size), in address order.
        chunks: Vec<(OwnedFd, u64, u64)>,
        /// Offset of the KV range from the first chunk.
        offset_bytes: u64,
        /// Bytes of the KV range.
        size_bytes: u64,
    },
    /// A legacy CUDA IPC handle of an allocation's base, and the range of it that holds the KV
    /// cache.
    CudaIpc {
        /// `cuIpcGetMemHandle` of the allocation base.
        handle: [u8; IPC_HANDLE_BYTES],
        /// Offset of the KV range from the allocation base.
        offset_bytes: u64,
        /// Bytes of the KV range.
        size_bytes: u64,
    },
}

/// An imported client allocation. Dropping it unmaps or closes it.
pub trait ImportedMemory: Send + Sync + fmt::Debug {
    /// Bytes that copies may address, from offset 0.
    fn size_bytes(&self) -> u64;
    /// For the backend's own engine to reach its concrete type.
    fn as_any(&self) -> &dyn Any;
}

/// A registration's interprocess events: the client's (kvd waits on them before a copy) and
/// kvd's own (recorded after a copy; the client polls them).
pub trait EventRing: Send + Sync + fmt::Debug {
    /// IPC handles of kvd's own events, in slot order, for the registration reply.
    fn server_handles(&self) -> Vec<[u8; IPC_HANDLE_BYTES]>;
    /// For the backend's own engine to reach its concrete type.
    fn as_any(&self) -> &dyn Any;
}

/// A submitted copy.
pub trait Completion: Send + fmt::Debug {
    /// kvd's event slot that the client can poll for this copy. `None` when the client gave
    /// no events: kvd then replies only after [`Completion::wait`].
    fn event_slot(&self) -> Option<u16>;
    /// Blocks the calling thread until the copy is complete.
    fn wait(self: Box<Self>) -> Result<(), GpuError>;
}

/// Runs copies for one device. Owned by that device's copy thread.
pub trait CopyEngine: Send + fmt::Debug {
    /// Enqueues (or, on the host backend, performs) one job.
    fn submit(&mut self, job: &CopyJob) -> Result<Box<dyn Completion>, GpuError>;
}

/// One device.
pub trait Device: Send + Sync + fmt::Debug {
    /// A short name for logs and metrics, e.g. `host` or `cuda:0`.
    fn label(&self) -> String;
    /// Imports client memory.
    fn import(&self, source: ImportSource) -> Result<Arc<dyn ImportedMemory>, GpuError>;
    /// Opens a registration's event ring from the client's event handles.
    fn open_events(
        &self,
        client_handles: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<Option<Arc<dyn EventRing>>, GpuError>;
    /// The device's PCI bus id (`0000:1B:00.0`), where it has one, to find its NUMA node.
    fn pci_bus_id(&self) -> Option<String> {
        None
    }
    /// Starts a copy engine between this device and the pool.
    fn copy_engine(&self, pool: Arc<PoolMemory>) -> Result<Box<dyn CopyEngine>, GpuError>;
}

/// Keeps the pool registered (pinned) with a GPU driver; dropping it unregisters.
pub trait PinnedPool: Send + Sync + fmt::Debug {}

/// A registration of the pool with a GPU driver.
pub type PoolPin = Box<dyn PinnedPool>;

/// A GPU driver: finds devices by UUID and pins the pool.
pub trait GpuBackend: Send + Sync + fmt::Debug {
    /// Opens the device with this UUID; also returns its ordinal, to name its copy thread.
    fn device(&self, uuid: &[u8; 16]) -> Result<(Arc<dyn Device>, usize), GpuError>;
    /// Registers pieces `pieces` of the pool's layout for DMA (portable, device-mapped), one
    /// registration per piece, so that no page (a slab is a piece) spans two registrations.
    /// The pool can be pinned in several calls over disjoint ranges, as it grows.
    fn pin_pool(&self, pool: &Arc<PoolMemory>, pieces: Range<u32>) -> Result<PoolPin, GpuError>;
}
