//! The device layer the server programs against. A [`Device`] is one GPU (or, for the host
//! backend, the machine itself); it imports a registration's memory and events as one
//! [`Imports`] value and starts the one [`CopyEngine`] that the server runs on that device's own
//! thread. Backends: `host` (memfd memory shared by file descriptor, so every server path runs in
//! CI), `cuda` and `hip`.
//!
//! Backends are enum variants chosen at start, not trait objects found again by downcasting:
//! each backend's engine takes only its own backend's imports (`CudaEngine::submit` takes
//! `&CudaImports`), so a CUDA engine cannot be handed host memory. The one place where a
//! registration meets an engine of another backend is [`CopyEngine::submit`], whose `match`
//! answers such a pairing with an error instead of a downcast that could be forgotten.

use std::fmt;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use crate::copy::CopyJob;
use crate::error::GpuError;
use crate::host::{HostCompletion, HostCopyEngine, HostDevice, HostImports};
use crate::memory::PoolMemory;

#[cfg(feature = "cuda")]
use crate::cuda::{CudaBackend, CudaCompletion, CudaDevice, CudaEngine, CudaImports};
#[cfg(feature = "hip")]
use crate::hip::{HipBackend, HipCompletion, HipDevice, HipEngine, HipImports};

/// Size of an IPC memory or event handle (CUDA and HIP alike).
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
    /// GPU VMM memory (CUDA or HIP) shared as one descriptor per physical chunk.
    CudaVmm {
        /// (descriptor, offset of the chunk from the first chunk, chunk size), in address order.
        chunks: Vec<(OwnedFd, u64, u64)>,
        /// Offset of the KV range from the first chunk.
        offset_bytes: u64,
        /// Bytes of the KV range.
        size_bytes: u64,
    },
    /// A legacy IPC handle (CUDA or HIP) of an allocation's base, and the range of it that
    /// holds the KV cache.
    CudaIpc {
        /// `cuIpcGetMemHandle`/`hipIpcGetMemHandle` of the allocation base.
        handle: [u8; IPC_HANDLE_BYTES],
        /// Offset of the KV range from the allocation base.
        offset_bytes: u64,
        /// Bytes of the KV range.
        size_bytes: u64,
    },
}

/// A registration's imported allocations and interprocess events, all of one backend and one
/// device. Dropping the last reference unmaps the memory and destroys the events; copy jobs hold
/// a reference until the device is done with them.
#[derive(Debug)]
pub enum Imports {
    /// memfd mappings.
    Host(HostImports),
    /// CUDA IPC or VMM imports and CUDA events.
    #[cfg(feature = "cuda")]
    Cuda(CudaImports),
    /// HIP IPC or VMM imports and HIP events.
    #[cfg(feature = "hip")]
    Hip(HipImports),
}

impl Imports {
    /// Number of allocations, the range of a copy run's `memory` index.
    pub fn len(&self) -> usize {
        match self {
            Imports::Host(i) => i.memories.len(),
            #[cfg(feature = "cuda")]
            Imports::Cuda(i) => i.memories.len(),
            #[cfg(feature = "hip")]
            Imports::Hip(i) => i.memories.len(),
        }
    }

    /// Whether the registration has no allocations.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the registration has interprocess events (a copy may then name a wait slot).
    pub fn has_events(&self) -> bool {
        match self {
            Imports::Host(_) => false,
            #[cfg(feature = "cuda")]
            Imports::Cuda(i) => i.events.is_some(),
            #[cfg(feature = "hip")]
            Imports::Hip(i) => i.events.is_some(),
        }
    }

    /// IPC handles of kvd's own events, in slot order, for the registration reply.
    pub fn server_handles(&self) -> Vec<[u8; IPC_HANDLE_BYTES]> {
        match self {
            Imports::Host(_) => Vec::new(),
            #[cfg(feature = "cuda")]
            Imports::Cuda(i) => i
                .events
                .as_ref()
                .map(|e| e.server_handles().to_vec())
                .unwrap_or_default(),
            #[cfg(feature = "hip")]
            Imports::Hip(i) => i
                .events
                .as_ref()
                .map(|e| e.server_handles().to_vec())
                .unwrap_or_default(),
        }
    }
}

/// A submitted copy.
#[derive(Debug)]
pub enum Completion {
    /// A host copy, finished before `submit` returned.
    Host(HostCompletion),
    /// A CUDA copy: an event recorded after its last descriptor.
    #[cfg(feature = "cuda")]
    Cuda(CudaCompletion),
    /// A HIP copy: an event recorded after its last descriptor.
    #[cfg(feature = "hip")]
    Hip(HipCompletion),
}

impl Completion {
    /// kvd's event slot that the client can poll for this copy. `None` when the client gave
    /// no events: kvd then replies only after [`Completion::wait`].
    pub fn event_slot(&self) -> Option<u16> {
        match self {
            Completion::Host(_) => None,
            #[cfg(feature = "cuda")]
            Completion::Cuda(c) => c.event_slot(),
            #[cfg(feature = "hip")]
            Completion::Hip(c) => c.event_slot(),
        }
    }

    /// Blocks the calling thread until the copy is complete.
    pub fn wait(self) -> Result<(), GpuError> {
        match self {
            Completion::Host(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Completion::Cuda(c) => c.wait(),
            #[cfg(feature = "hip")]
            Completion::Hip(c) => c.wait(),
        }
    }
}

/// Runs copies for one device. Owned by that device's copy thread.
#[derive(Debug)]
pub enum CopyEngine {
    /// CPU copies.
    Host(HostCopyEngine),
    /// A CUDA GPU's copy engines.
    #[cfg(feature = "cuda")]
    Cuda(CudaEngine),
    /// A HIP GPU's DMA (SDMA) engines.
    #[cfg(feature = "hip")]
    Hip(HipEngine),
}

impl CopyEngine {
    /// Enqueues (or, on the host backend, performs) one job.
    pub fn submit(&mut self, job: &CopyJob) -> Result<Completion, GpuError> {
        match (self, &*job.imports) {
            (CopyEngine::Host(e), Imports::Host(i)) => e.submit(job, i).map(Completion::Host),
            #[cfg(feature = "cuda")]
            (CopyEngine::Cuda(e), Imports::Cuda(i)) => e.submit(job, i).map(Completion::Cuda),
            #[cfg(feature = "hip")]
            (CopyEngine::Hip(e), Imports::Hip(i)) => e.submit(job, i).map(Completion::Hip),
            #[allow(unreachable_patterns)]
            (engine, imports) => Err(GpuError::Invalid(format!(
                "a {} copy engine was given {} memory",
                engine.backend(),
                imports.backend()
            ))),
        }
    }

    fn backend(&self) -> &'static str {
        match self {
            CopyEngine::Host(_) => "host",
            #[cfg(feature = "cuda")]
            CopyEngine::Cuda(_) => "CUDA",
            #[cfg(feature = "hip")]
            CopyEngine::Hip(_) => "HIP",
        }
    }
}

impl Imports {
    fn backend(&self) -> &'static str {
        match self {
            Imports::Host(_) => "host",
            #[cfg(feature = "cuda")]
            Imports::Cuda(_) => "CUDA",
            #[cfg(feature = "hip")]
            Imports::Hip(_) => "HIP",
        }
    }
}

/// One device.
#[derive(Debug)]
pub enum Device {
    /// The machine itself (memfd "device memory").
    Host(HostDevice),
    /// A GPU driven through CUDA.
    #[cfg(feature = "cuda")]
    Cuda(CudaDevice),
    /// A GPU driven through HIP.
    #[cfg(feature = "hip")]
    Hip(HipDevice),
}

impl Device {
    /// A short name for logs and metrics, e.g. `host`, `cuda:0 (GPU-…)` or `hip:0 (…)`.
    pub fn label(&self) -> String {
        match self {
            Device::Host(_) => "host".to_string(),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.label(),
            #[cfg(feature = "hip")]
            Device::Hip(d) => d.label(),
        }
    }

    /// Imports a registration: its allocations, and its event ring from the client's event
    /// handles (kvd creates `server_slots` events of its own when the client sent any).
    pub fn import(
        &self,
        sources: Vec<ImportSource>,
        client_events: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<Imports, GpuError> {
        match self {
            Device::Host(d) => d
                .import(sources, client_events, server_slots)
                .map(Imports::Host),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d
                .import(sources, client_events, server_slots)
                .map(Imports::Cuda),
            #[cfg(feature = "hip")]
            Device::Hip(d) => d
                .import(sources, client_events, server_slots)
                .map(Imports::Hip),
        }
    }

    /// The device's PCI bus id (`0000:1B:00.0`), where it has one, to find its NUMA node.
    pub fn pci_bus_id(&self) -> Option<String> {
        match self {
            Device::Host(_) => None,
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.pci_bus_id(),
            #[cfg(feature = "hip")]
            Device::Hip(_) => None,
        }
    }

    /// Starts a copy engine between this device and the pool, on the calling thread (the copy
    /// thread: a GPU backend makes its device current there).
    pub fn copy_engine(&self, pool: Arc<PoolMemory>) -> Result<CopyEngine, GpuError> {
        match self {
            Device::Host(_) => Ok(CopyEngine::Host(HostCopyEngine::new(pool))),
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => d.copy_engine(pool).map(CopyEngine::Cuda),
            #[cfg(feature = "hip")]
            Device::Hip(d) => d.copy_engine(pool).map(CopyEngine::Hip),
        }
    }
}

/// Formats a UUID the way nvidia-smi does.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}

/// Keeps the pool registered (pinned) with a GPU driver; dropping it unregisters.
pub trait PinnedPool: Send + Sync + fmt::Debug {}

/// A registration of the pool with a GPU driver.
pub type PoolPin = Box<dyn PinnedPool>;

/// The GPU driver kvd found at start: NVIDIA's through CUDA or AMD's through HIP.
#[derive(Debug, Clone)]
pub enum GpuBackend {
    /// The CUDA driver (`libcuda.so.1`).
    #[cfg(feature = "cuda")]
    Cuda(Arc<CudaBackend>),
    /// The HIP runtime (`libamdhip64.so`).
    #[cfg(feature = "hip")]
    Hip(Arc<HipBackend>),
}

impl GpuBackend {
    /// `CUDA` or `HIP`, for logs and errors.
    pub fn name(&self) -> &'static str {
        match *self {
            #[cfg(feature = "cuda")]
            GpuBackend::Cuda(_) => "CUDA",
            #[cfg(feature = "hip")]
            GpuBackend::Hip(_) => "HIP",
        }
    }

    /// Opens the device with this UUID; also returns its ordinal, to name its copy thread.
    pub fn device(&self, uuid: &[u8; 16]) -> Result<(Device, usize), GpuError> {
        match *self {
            #[cfg(feature = "cuda")]
            GpuBackend::Cuda(ref b) => b.device(uuid).map(|(d, o)| (Device::Cuda(d), o)),
            #[cfg(feature = "hip")]
            GpuBackend::Hip(ref b) => b.device(uuid).map(|(d, o)| (Device::Hip(d), o)),
        }
    }

    /// Registers pieces `pieces` of the pool's layout for DMA (portable, device-mapped), one
    /// registration per piece, so that no page (a slab is a piece) spans two registrations.
    /// The pool can be pinned in several calls over disjoint ranges, as it grows.
    pub fn pin_pool(
        &self,
        pool: &Arc<PoolMemory>,
        pieces: Range<u32>,
    ) -> Result<PoolPin, GpuError> {
        match *self {
            #[cfg(feature = "cuda")]
            GpuBackend::Cuda(ref b) => b.pin_pool(pool, pieces),
            #[cfg(feature = "hip")]
            GpuBackend::Hip(ref b) => b.pin_pool(pool, pieces),
        }
    }
}
