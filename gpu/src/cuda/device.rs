//! kvd's side of CUDA: the backend (devices by UUID, pinning the pool) and one device (its
//! primary context, imports of client allocations, event rings, copy engine).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Weak};

use cudarc::driver::sys;
use parking_lot::Mutex;

use super::driver::{self, check, format_uuid, release_failed, Context, PrimaryContext};
use super::engine::CudaEngine;
use super::events::CudaEvents;
use super::ipc::{IpcMemory, IpcRange};
use super::vmm::VmmImport;
use crate::device::{ImportSource, PinnedPool, PoolPin, IPC_HANDLE_BYTES};
use crate::error::GpuError;
use crate::memory::PoolMemory;

/// What kvd knows about one GPU.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Ordinal in kvd's own view (its `CUDA_VISIBLE_DEVICES`).
    pub ordinal: i32,
    /// UUID.
    pub uuid: [u8; 16],
    /// Marketing name.
    pub name: String,
}

/// The CUDA driver as kvd uses it.
#[derive(Debug)]
pub struct CudaBackend {
    devices: Vec<DeviceInfo>,
    opened: Mutex<HashMap<[u8; 16], Arc<DeviceInner>>>,
}

impl CudaBackend {
    /// Loads the driver and lists the GPUs. Fails (without panicking) where there is no driver.
    pub fn load() -> Result<Arc<Self>, GpuError> {
        driver::available()?;
        let n = driver::device_count()?;
        let mut devices = Vec::with_capacity(n as usize);
        for ordinal in 0..n {
            let (uuid, name) = driver::device_identity(ordinal)?;
            devices.push(DeviceInfo {
                ordinal,
                uuid,
                name,
            });
        }
        if devices.is_empty() {
            return Err(GpuError::Unavailable("the CUDA driver sees no GPU".into()));
        }
        Ok(Arc::new(CudaBackend {
            devices,
            opened: Mutex::new(HashMap::new()),
        }))
    }

    /// The GPUs kvd can see.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }
}

/// Keeps the pool registered with the driver.
#[derive(Debug)]
struct PinnedPoolGuard {
    ctx: PrimaryContext,
    pieces: Vec<(usize, usize)>,
    _pool: Arc<PoolMemory>,
}

impl PinnedPool for PinnedPoolGuard {}

impl Drop for PinnedPoolGuard {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.make_current() {
            release_failed("the pinned pool", e);
            return;
        }
        for &(ptr, _) in &self.pieces {
            // SAFETY: each piece was registered by `pin_pool` and is unregistered once; the pool
            // mapping outlives this guard (it holds an Arc to it).
            let r = unsafe { sys::cuMemHostUnregister(ptr as *mut std::ffi::c_void) };
            if let Err(e) = check("cuMemHostUnregister", r) {
                release_failed("a pinned pool piece", e);
            }
        }
    }
}

impl CudaBackend {
    /// Opens the device with this UUID; also returns its ordinal, to name its copy thread.
    pub fn device(&self, uuid: &[u8; 16]) -> Result<(CudaDevice, usize), GpuError> {
        let info = self
            .devices
            .iter()
            .find(|d| &d.uuid == uuid)
            .ok_or_else(|| {
                let seen: Vec<String> = self.devices.iter().map(|d| format_uuid(&d.uuid)).collect();
                GpuError::Unavailable(format!(
                "kvd cannot see GPU {}; it sees {}. Run kvd with every GPU of the node visible \
                 (unset CUDA_VISIBLE_DEVICES for kvd, or give its container all GPUs)",
                format_uuid(uuid),
                seen.join(", ")
            ))
            })?;
        let mut opened = self.opened.lock();
        let inner = match opened.get(uuid) {
            Some(i) => i.clone(),
            None => {
                let ctx = PrimaryContext::retain_for_copies(info.ordinal)?;
                let inner = Arc::new(DeviceInner {
                    label: format!("cuda:{} ({})", info.ordinal, format_uuid(uuid)),
                    ordinal: info.ordinal,
                    ctx,
                    ipc: Mutex::new(HashMap::new()),
                });
                opened.insert(*uuid, inner.clone());
                inner
            }
        };
        Ok((CudaDevice { inner }, info.ordinal as usize))
    }

    /// Registers pieces `pieces` of the pool's layout for DMA (portable, device-mapped).
    pub fn pin_pool(
        &self,
        pool: &Arc<PoolMemory>,
        pieces: Range<u32>,
    ) -> Result<PoolPin, GpuError> {
        let layout = *pool.layout();
        if pieces.end > layout.pieces() {
            return Err(GpuError::Invalid(format!(
                "pinning pieces {pieces:?} of a pool of {} pieces",
                layout.pieces()
            )));
        }
        let ctx = PrimaryContext::retain_for_copies(self.devices[0].ordinal)?;
        ctx.make_current()?;
        let base = pool.base_ptr() as usize;
        let pieces: Vec<(usize, usize)> = pieces
            .map(|p| {
                let r = layout.piece_range(p);
                (base + r.start as usize, (r.end - r.start) as usize)
            })
            .collect();
        // Register pieces on a few threads: a page never spans two pieces (pieces are whole
        // slabs), so no copy crosses a registration.
        let threads = pieces.len().clamp(1, 8);
        let per = pieces.len().div_ceil(threads);
        let ctx_handle = ctx.ctx;
        // Each thread returns the pieces it registered and the error that stopped it, if any.
        let results: Vec<Registered> = std::thread::scope(|s| {
            let handles: Vec<_> = pieces
                .chunks(per)
                .map(|mine| s.spawn(move || register_pieces(ctx_handle, mine)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| Registered {
                        pieces: Vec::new(),
                        error: Some(GpuError::Invalid("a pinning thread panicked".into())),
                    })
                })
                .collect()
        });
        let mut registered = Vec::new();
        let mut failure = None;
        for r in results {
            registered.extend(r.pieces);
            if let Some(e) = r.error {
                failure.get_or_insert(e);
            }
        }
        let guard = PinnedPoolGuard {
            ctx,
            pieces: registered,
            _pool: pool.clone(),
        };
        match failure {
            // Dropping the guard unregisters what was registered: failure unwinds.
            Some(e) => Err(e),
            None => Ok(Box::new(guard)),
        }
    }
}

struct Registered {
    pieces: Vec<(usize, usize)>,
    error: Option<GpuError>,
}

fn register_pieces(ctx: Context, mine: &[(usize, usize)]) -> Registered {
    let mut out = Registered {
        pieces: Vec::new(),
        error: None,
    };
    // The caller keeps the context retained while this runs.
    if let Err(e) = ctx.make_current() {
        out.error = Some(e);
        return out;
    }
    for &(ptr, len) in mine {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: [ptr, ptr+len) lies inside the pool's mapping, which the caller keeps alive;
        // pieces are disjoint.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr as *mut std::ffi::c_void, len, flags) };
        if let Err(e) = check("cuMemHostRegister_v2", r) {
            out.error = Some(e);
            return out;
        }
        out.pieces.push((ptr, len));
    }
    out
}

/// State shared by a device and everything imported on it.
#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) label: String,
    pub(crate) ordinal: i32,
    pub(crate) ctx: PrimaryContext,
    /// One mapping per allocation: a second registration of the same allocation (a client
    /// that reconnects) shares the first one's mapping.
    ipc: Mutex<HashMap<[u8; IPC_HANDLE_BYTES], Weak<IpcMemory>>>,
}

/// Client memory imported on a CUDA GPU, however it was shared.
#[derive(Debug)]
pub enum CudaMemory {
    /// A range of an allocation opened by legacy IPC handle.
    Ipc(IpcRange),
    /// VMM chunks imported by descriptor and mapped into one range.
    Vmm(VmmImport),
}

impl CudaMemory {
    /// Device address of `offset` within the KV range, checked for `len` bytes.
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<sys::CUdeviceptr, GpuError> {
        match self {
            CudaMemory::Ipc(r) => r.device_ptr(offset, len),
            CudaMemory::Vmm(v) => v.device_ptr(offset, len),
        }
    }

    pub(crate) fn device(&self) -> &Arc<DeviceInner> {
        match self {
            CudaMemory::Ipc(r) => r.device(),
            CudaMemory::Vmm(v) => v.device(),
        }
    }
}

/// A registration on a CUDA GPU: its imported allocations and event ring.
#[derive(Debug)]
pub struct CudaImports {
    /// The allocations, in registration order.
    pub memories: Vec<CudaMemory>,
    /// Both sides' interprocess events, when the client sent any.
    pub events: Option<CudaEvents>,
}

/// One GPU.
#[derive(Debug)]
pub struct CudaDevice {
    inner: Arc<DeviceInner>,
}

impl CudaDevice {
    /// A short name for logs and metrics.
    pub fn label(&self) -> String {
        self.inner.label.clone()
    }

    /// The device's PCI bus id, to find its NUMA node.
    pub fn pci_bus_id(&self) -> Option<String> {
        driver::pci_bus_id(self.inner.ordinal)
            .map_err(|e| tracing::warn!("{}: no PCI bus id ({e})", self.inner.label))
            .ok()
    }

    /// Imports a registration's allocations and opens its event ring.
    pub fn import(
        &self,
        sources: Vec<ImportSource>,
        client_events: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<CudaImports, GpuError> {
        let memories = sources
            .into_iter()
            .map(|s| self.import_one(s))
            .collect::<Result<Vec<_>, _>>()?;
        let events = if client_events.is_empty() {
            None
        } else {
            Some(CudaEvents::open(
                self.inner.clone(),
                client_events,
                server_slots,
            )?)
        };
        Ok(CudaImports { memories, events })
    }

    fn import_one(&self, source: ImportSource) -> Result<CudaMemory, GpuError> {
        match source {
            ImportSource::CudaIpc {
                handle,
                offset_bytes,
                size_bytes,
            } => {
                let mut cache = self.inner.ipc.lock();
                if let Some(m) = cache.get(&handle).and_then(Weak::upgrade) {
                    return m.with_range(offset_bytes, size_bytes).map(CudaMemory::Ipc);
                }
                let m = Arc::new(IpcMemory::open(self.inner.clone(), handle)?);
                cache.retain(|_, w| w.strong_count() > 0);
                cache.insert(handle, Arc::downgrade(&m));
                m.with_range(offset_bytes, size_bytes).map(CudaMemory::Ipc)
            }
            ImportSource::CudaVmm {
                chunks,
                offset_bytes,
                size_bytes,
            } => Ok(CudaMemory::Vmm(VmmImport::import(
                self.inner.clone(),
                chunks,
                offset_bytes,
                size_bytes,
            )?)),
            ImportSource::HostFd { .. } => Err(GpuError::Invalid(
                "memfd memory belongs to the host backend; register it with device Host".into(),
            )),
        }
    }

    /// Starts the copy engine, making the device's context current on the calling thread.
    pub fn copy_engine(&self, pool: Arc<PoolMemory>) -> Result<CudaEngine, GpuError> {
        CudaEngine::new(self.inner.clone(), pool)
    }
}
