//! The device layer the server programs against. A [`Device`] is one GPU (or, for the host
//! backend, the machine itself); it imports a registration's memory and events as one
//! [`Imports`] value and starts the one [`CopyEngine`] that the server runs on that device's own
//! thread. Backends: `host` (memfd memory shared by file descriptor, so every server path runs in
//! CI), and the GPU runtimes, CUDA and HIP, both through the generic types of
//! [`crate::runtime`].
//!
//! Backends are enum variants chosen at start, not trait objects found again by downcasting:
//! each backend's engine takes only its own backend's imports (`CudaEngine::submit` takes
//! `&CudaImports`), so a CUDA engine cannot be handed host memory. The one place where a
//! registration meets an engine of another backend is [`CopyEngine::submit`], whose `match`
//! answers such a pairing with an error instead of a downcast that could be forgotten. The GPU
//! arms of every other `match` are written once, by `each_gpu!`.

use std::ops::Range;
use std::sync::Arc;

use crate::copy::{CopyRun, Direction, SubmitTimes, Transfer};
use crate::error::GpuError;
use crate::host::{HostCompletion, HostCopyEngine, HostDevice, HostImports};
use crate::memory::PoolMemory;
use crate::types::{ImportSource, PoolPin, IPC_HANDLE_BYTES};

#[cfg(feature = "cuda")]
use crate::cuda::{CudaBackend, CudaCompletion, CudaDevice, CudaEngine, CudaImports};
#[cfg(feature = "hip")]
use crate::hip::{HipBackend, HipCompletion, HipDevice, HipEngine, HipImports};

/// Matches `$value`, an enum `$Enum` with `Cuda` and `Hip` variants, binding the GPU variant's
/// value to `$v` for `$body` and, where given, `$wrap` to the same variant of `$Into`; the arms
/// after `;` (the host's) are added as written. Each GPU arm is compiled only with its feature.
macro_rules! each_gpu {
    ($value:expr, $Enum:ident($v:ident) $(, $wrap:ident = $Into:ident)? => $body:expr; $($rest:tt)*) => {
        match $value {
            #[cfg(feature = "cuda")]
            $Enum::Cuda($v) => {
                $(let $wrap = $Into::Cuda;)?
                $body
            }
            #[cfg(feature = "hip")]
            $Enum::Hip($v) => {
                $(let $wrap = $Into::Hip;)?
                $body
            }
            $($rest)*
        }
    };
}

/// One unit of work for a device's copy engine.
#[derive(Debug, Clone)]
pub struct CopyJob {
    /// Which way the bytes go.
    pub direction: Direction,
    /// The registration's allocations (runs index into them) and events, where the device has
    /// events (CUDA, HIP). The job holds them until the device is done with its copies.
    pub imports: Arc<Imports>,
    /// What to copy; already coalesced.
    pub runs: Vec<CopyRun>,
    /// Client event slot to wait on before copying (the client recorded it after its forward).
    pub wait_slot: Option<u16>,
}

impl CopyJob {
    /// What the engine copies, without the imports.
    pub fn transfer(&self) -> Transfer<'_> {
        Transfer {
            direction: self.direction,
            runs: &self.runs,
            wait_slot: self.wait_slot,
        }
    }
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
        each_gpu!(self, Imports(i) => i.memories.len(); Imports::Host(i) => i.memories.len(),)
    }

    /// Whether the registration has no allocations.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the registration has interprocess events (a copy may then name a wait slot).
    pub fn has_events(&self) -> bool {
        each_gpu!(self, Imports(i) => i.events.is_some(); Imports::Host(_) => false,)
    }

    /// IPC handles of kvd's own events, in slot order, for the registration reply.
    pub fn server_handles(&self) -> Vec<[u8; IPC_HANDLE_BYTES]> {
        each_gpu!(self, Imports(i) => i
            .events
            .as_ref()
            .map(|e| e.server_handles().to_vec())
            .unwrap_or_default();
            Imports::Host(_) => Vec::new(),
        )
    }

    fn backend(&self) -> &'static str {
        each_gpu!(self, Imports(_i) => backend_name(_i); Imports::Host(_) => "host",)
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
        each_gpu!(self, Completion(c) => c.event_slot(); Completion::Host(_) => None,)
    }

    /// Blocks the calling thread until the copy is complete.
    pub fn wait(self) -> Result<(), GpuError> {
        each_gpu!(self, Completion(c) => c.wait(); Completion::Host(_) => Ok(()),)
    }
}

/// Runs copies for one device. Owned by the copy thread that submits to it (the server runs one
/// for each direction).
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
        let transfer = job.transfer();
        match (self, &*job.imports) {
            (CopyEngine::Host(e), Imports::Host(i)) => e.submit(transfer, i).map(Completion::Host),
            #[cfg(feature = "cuda")]
            (CopyEngine::Cuda(e), Imports::Cuda(i)) => e.submit(transfer, i).map(Completion::Cuda),
            #[cfg(feature = "hip")]
            (CopyEngine::Hip(e), Imports::Hip(i)) => e.submit(transfer, i).map(Completion::Hip),
            #[allow(unreachable_patterns)]
            (engine, imports) => Err(GpuError::Invalid(format!(
                "a {} copy engine was given {} memory",
                engine.backend(),
                imports.backend()
            ))),
        }
    }

    /// Where the last submission's time went, on a GPU (the host backend's is its memcpy).
    pub fn last_submit(&self) -> Option<SubmitTimes> {
        each_gpu!(self, CopyEngine(e) => Some(e.last_submit()); CopyEngine::Host(_) => None,)
    }

    fn backend(&self) -> &'static str {
        each_gpu!(self, CopyEngine(_e) => backend_name(_e); CopyEngine::Host(_) => "host",)
    }
}

/// The name of the runtime a generic GPU value belongs to.
#[cfg(any(feature = "cuda", feature = "hip"))]
fn backend_name<T: crate::runtime::OfRuntime>(_: &T) -> &'static str {
    T::RUNTIME_NAME
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
        each_gpu!(self, Device(d) => d.label(); Device::Host(_) => "host".to_string(),)
    }

    /// Imports a registration: its allocations, and its event ring from the client's event
    /// handles (kvd creates `server_slots` events of its own when the client sent any).
    pub fn import(
        &self,
        sources: Vec<ImportSource>,
        client_events: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<Imports, GpuError> {
        each_gpu!(self, Device(d), wrap = Imports =>
            d.import(sources, client_events, server_slots).map(wrap);
            Device::Host(d) => d
                .import(sources, client_events, server_slots)
                .map(Imports::Host),
        )
    }

    /// The device's PCI bus id (`0000:1B:00.0`), where it has one, to find its NUMA node.
    pub fn pci_bus_id(&self) -> Option<String> {
        each_gpu!(self, Device(d) => d.pci_bus_id(); Device::Host(_) => None,)
    }

    /// Starts a copy engine between this device and the pool, on the calling thread (the copy
    /// thread: a GPU backend makes its device current there).
    pub fn copy_engine(&self, pool: Arc<PoolMemory>) -> Result<CopyEngine, GpuError> {
        each_gpu!(self, Device(d), wrap = CopyEngine => d.copy_engine(pool).map(wrap);
            Device::Host(_) => Ok(CopyEngine::Host(HostCopyEngine::new(pool))),
        )
    }
}

/// Formats a UUID the way nvidia-smi does.
pub fn format_uuid(u: &[u8; 16]) -> String {
    crate::types::format_nvidia_uuid(u)
}

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
        each_gpu!(self, GpuBackend(b) => backend_name(&**b);)
    }

    /// The GPUs the backend sees.
    #[cfg(any(feature = "cuda", feature = "hip"))]
    pub fn devices(&self) -> &[crate::runtime::DeviceInfo] {
        each_gpu!(self, GpuBackend(b) => b.devices();)
    }

    /// Opens the device with this UUID; also returns its ordinal, to name its copy threads.
    pub fn device(&self, uuid: &[u8; 16]) -> Result<(Device, usize), GpuError> {
        each_gpu!(self, GpuBackend(b), wrap = Device => b.device(uuid).map(|(d, o)| (wrap(d), o));)
    }

    /// Registers pieces `pieces` of the pool's layout for DMA (portable, device-mapped), one
    /// registration per piece, so that no page (a slab is a piece) spans two registrations.
    /// The pool can be pinned in several calls over disjoint ranges, as it grows.
    pub fn pin_pool(
        &self,
        pool: &Arc<PoolMemory>,
        pieces: Range<u32>,
    ) -> Result<PoolPin, GpuError> {
        each_gpu!(self, GpuBackend(b) => b.pin_pool(pool, pieces);)
    }
}

#[cfg(test)]
#[path = "host_tests.rs"]
mod host_tests;
