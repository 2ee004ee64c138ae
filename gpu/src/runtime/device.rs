//! kvd's side of a GPU runtime: the backend (GPUs by UUID, pinning the pool) and one device
//! (imports of client allocations, event rings, copy engine). A device is opened once per UUID
//! and shared by every registration on it, so that a second registration of the same allocation
//! (a client that reconnects) shares the first one's IPC mapping: a runtime maps an allocation
//! once per process.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use crate::error::GpuError;
use crate::memory::PoolMemory;
use crate::runtime::api::Runtime;
use crate::runtime::ctx::DeviceCtx;
use crate::runtime::engine::GpuEngine;
use crate::runtime::events::EventRing;
use crate::runtime::imports::{GpuImports, GpuMemory};
use crate::runtime::ipc::IpcMemory;
use crate::runtime::pin::pin_pool;
use crate::runtime::vmm::VmmImport;
use crate::types::{ImportSource, PoolPin, IPC_HANDLE_BYTES};

/// What kvd knows about one GPU.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Ordinal in kvd's own view (its `CUDA_VISIBLE_DEVICES`, `HIP_VISIBLE_DEVICES`).
    pub ordinal: i32,
    /// UUID, the same in every process.
    pub uuid: [u8; 16],
    /// Marketing name.
    pub name: String,
}

/// A GPU runtime as kvd uses it: the GPUs it sees and the devices opened so far.
#[derive(Debug)]
pub struct Backend<R: Runtime> {
    devices: Vec<DeviceInfo>,
    opened: Mutex<HashMap<[u8; 16], Arc<DeviceState<R>>>>,
}

impl<R: Runtime> Backend<R> {
    /// Loads the runtime and lists the GPUs. Fails (without panicking) where there is none.
    pub fn load() -> Result<Arc<Self>, GpuError> {
        R::available()?;
        let n = R::device_count()?;
        let mut devices = Vec::with_capacity(n.max(0) as usize);
        for ordinal in 0..n {
            let (uuid, name) = R::device_identity(ordinal)?;
            devices.push(DeviceInfo {
                ordinal,
                uuid,
                name,
            });
        }
        if devices.is_empty() {
            return Err(GpuError::Unavailable(format!("{} sees no GPU", R::DRIVER)));
        }
        Ok(Arc::new(Backend {
            devices,
            opened: Mutex::new(HashMap::new()),
        }))
    }

    /// The GPUs kvd can see.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// Opens the device with this UUID; also returns its ordinal, to name its copy threads.
    pub fn device(&self, uuid: &[u8; 16]) -> Result<(GpuDevice<R>, usize), GpuError> {
        let info = self
            .devices
            .iter()
            .find(|d| &d.uuid == uuid)
            .ok_or_else(|| {
                let seen: Vec<String> = self
                    .devices
                    .iter()
                    .map(|d| R::format_uuid(&d.uuid))
                    .collect();
                GpuError::Unavailable(format!(
                    "kvd cannot see GPU {}; it sees {}. Run kvd with every GPU of the node visible \
                     ({})",
                    R::format_uuid(uuid),
                    seen.join(", "),
                    R::VISIBILITY_FIX
                ))
            })?;
        let mut opened = self.opened.lock();
        let state = match opened.get(uuid) {
            Some(s) => s.clone(),
            None => {
                let ctx = R::retain_for_copies(info.ordinal)?;
                let state = Arc::new(DeviceState {
                    ctx: Arc::new(DeviceCtx {
                        label: format!("{}:{} ({})", R::LABEL, info.ordinal, R::format_uuid(uuid)),
                        ordinal: info.ordinal,
                        ctx,
                    }),
                    ipc: Mutex::new(HashMap::new()),
                });
                opened.insert(*uuid, state.clone());
                state
            }
        };
        Ok((GpuDevice { state }, info.ordinal as usize))
    }

    /// Registers pieces `pieces` of the pool's layout for DMA (portable, device-mapped), on the
    /// first GPU's context (a portable registration serves every GPU).
    pub fn pin_pool(
        &self,
        pool: &Arc<PoolMemory>,
        pieces: Range<u32>,
    ) -> Result<PoolPin, GpuError> {
        pin_pool::<R>(self.devices[0].ordinal, pool, pieces)
    }
}

/// An opened device and its allocations opened by IPC handle.
#[derive(Debug)]
struct DeviceState<R: Runtime> {
    ctx: Arc<DeviceCtx<R>>,
    /// One mapping per allocation: a second registration of the same allocation shares the
    /// first one's mapping.
    ipc: Mutex<HashMap<[u8; IPC_HANDLE_BYTES], Weak<IpcMemory<R>>>>,
}

/// One GPU.
#[derive(Debug)]
pub struct GpuDevice<R: Runtime> {
    state: Arc<DeviceState<R>>,
}

impl<R: Runtime> GpuDevice<R> {
    /// A short name for logs and metrics.
    pub fn label(&self) -> String {
        self.state.ctx.label.clone()
    }

    /// The device's PCI bus id, to find its NUMA node, where the runtime gives one.
    pub fn pci_bus_id(&self) -> Option<String> {
        R::pci_bus_id(self.state.ctx.ordinal)?
            .map_err(|e| tracing::warn!("{}: no PCI bus id ({e})", self.state.ctx.label))
            .ok()
    }

    /// Imports a registration's allocations and opens its event ring.
    pub fn import(
        &self,
        sources: Vec<ImportSource>,
        client_events: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<GpuImports<R>, GpuError> {
        let memories = sources
            .into_iter()
            .map(|s| self.import_one(s))
            .collect::<Result<Vec<_>, _>>()?;
        let events = if client_events.is_empty() {
            None
        } else {
            Some(EventRing::open(
                self.state.ctx.clone(),
                client_events,
                server_slots,
            )?)
        };
        Ok(GpuImports { memories, events })
    }

    fn import_one(&self, source: ImportSource) -> Result<GpuMemory<R>, GpuError> {
        match source {
            ImportSource::CudaIpc {
                handle,
                offset_bytes,
                size_bytes,
            } => {
                let mut cache = self.state.ipc.lock();
                if let Some(m) = cache.get(&handle).and_then(Weak::upgrade) {
                    return m.with_range(offset_bytes, size_bytes).map(GpuMemory::Ipc);
                }
                let m = Arc::new(IpcMemory::open(self.state.ctx.clone(), handle)?);
                cache.retain(|_, w| w.strong_count() > 0);
                cache.insert(handle, Arc::downgrade(&m));
                m.with_range(offset_bytes, size_bytes).map(GpuMemory::Ipc)
            }
            ImportSource::CudaVmm {
                chunks,
                offset_bytes,
                size_bytes,
            } => Ok(GpuMemory::Vmm(VmmImport::import(
                self.state.ctx.clone(),
                chunks,
                offset_bytes,
                size_bytes,
            )?)),
            ImportSource::HostFd { .. } => Err(GpuError::Invalid(
                "memfd memory belongs to the host backend; register it with device Host".into(),
            )),
        }
    }

    /// Starts the copy engine, making the device current on the calling thread.
    pub fn copy_engine(&self, pool: Arc<PoolMemory>) -> Result<GpuEngine<R>, GpuError> {
        GpuEngine::new(self.state.ctx.clone(), pool)
    }
}
