//! kvd's side of HIP: the backend (GPUs by UUID, pinning the pool) and one device (imports of
//! client allocations, event rings, copy engine). The same shape as the CUDA backend; where
//! CUDA retains a primary context, HIP's runtime only needs the device made current on the
//! calling thread.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::driver::{self, api, check, release_failed, set_device, DevicePtr};
use super::engine::HipEngine;
use super::events::HipEvents;
use super::ipc::{IpcMemory, IpcRange};
use super::vmm::VmmImport;
use crate::device::{ImportSource, PinnedPool, PoolPin, IPC_HANDLE_BYTES};
use crate::error::GpuError;
use crate::memory::PoolMemory;

/// What kvd knows about one GPU.
#[derive(Debug, Clone)]
pub struct DeviceInfo {
    /// Ordinal in kvd's own view (its `HIP_VISIBLE_DEVICES`/`ROCR_VISIBLE_DEVICES`).
    pub ordinal: i32,
    /// UUID as `hipDeviceGetUuid` gives it, the same in every process.
    pub uuid: [u8; 16],
    /// Marketing name.
    pub name: String,
}

/// The HIP runtime as kvd uses it.
#[derive(Debug)]
pub struct HipBackend {
    devices: Vec<DeviceInfo>,
    opened: Mutex<HashMap<[u8; 16], Arc<DeviceInner>>>,
}

impl HipBackend {
    /// Loads the runtime and lists the GPUs. Fails (without panicking) where there is no ROCm.
    pub fn load() -> Result<Arc<Self>, GpuError> {
        driver::available()?;
        let n = driver::device_count()?;
        let mut devices = Vec::with_capacity(n.max(0) as usize);
        for ordinal in 0..n {
            let (uuid, name) = driver::device_identity(ordinal)?;
            devices.push(DeviceInfo {
                ordinal,
                uuid,
                name,
            });
        }
        if devices.is_empty() {
            return Err(GpuError::Unavailable("the HIP runtime sees no GPU".into()));
        }
        Ok(Arc::new(HipBackend {
            devices,
            opened: Mutex::new(HashMap::new()),
        }))
    }

    /// The GPUs kvd can see.
    pub fn devices(&self) -> &[DeviceInfo] {
        &self.devices
    }

    /// Opens the device with this UUID; also returns its ordinal, to name its copy thread.
    pub fn device(&self, uuid: &[u8; 16]) -> Result<(HipDevice, usize), GpuError> {
        let info = self
            .devices
            .iter()
            .find(|d| &d.uuid == uuid)
            .ok_or_else(|| {
                let seen: Vec<String> = self.devices.iter().map(|d| format_uuid(&d.uuid)).collect();
                GpuError::Unavailable(format!(
                    "kvd cannot see GPU {}; it sees {}. Run kvd with every GPU of the node visible \
                     (unset HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES for kvd, or give its \
                     container /dev/kfd and every /dev/dri render node)",
                    format_uuid(uuid),
                    seen.join(", ")
                ))
            })?;
        let inner = self
            .opened
            .lock()
            .entry(*uuid)
            .or_insert_with(|| {
                Arc::new(DeviceInner {
                    label: format!("hip:{} ({})", info.ordinal, format_uuid(uuid)),
                    ordinal: info.ordinal,
                    ipc: Mutex::new(HashMap::new()),
                })
            })
            .clone();
        Ok((HipDevice { inner }, info.ordinal as usize))
    }

    /// Registers pieces `pieces` of the pool's layout for DMA (portable, mapped), one
    /// registration per piece (whole slabs, so that no page spans two registrations), on a few
    /// threads.
    pub fn pin_pool(
        &self,
        pool: &Arc<PoolMemory>,
        pieces: Range<u32>,
    ) -> Result<PoolPin, GpuError> {
        let ordinal = self.devices[0].ordinal;
        let layout = *pool.layout();
        if pieces.end > layout.pieces() {
            return Err(GpuError::Invalid(format!(
                "pinning pieces {pieces:?} of a pool of {} pieces",
                layout.pieces()
            )));
        }
        let base = pool.base_ptr() as usize;
        let pieces: Vec<(usize, usize)> = pieces
            .map(|p| {
                let r = layout.piece_range(p);
                (base + r.start as usize, (r.end - r.start) as usize)
            })
            .collect();
        let threads = pieces.len().clamp(1, 8);
        let per = pieces.len().div_ceil(threads);
        let results: Vec<Registered> = std::thread::scope(|s| {
            let handles: Vec<_> = pieces
                .chunks(per)
                .map(|mine| s.spawn(move || register_pieces(ordinal, mine)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        (
                            Vec::new(),
                            Some(GpuError::Invalid("a pinning thread panicked".into())),
                        )
                    })
                })
                .collect()
        });
        let mut registered = Vec::new();
        let mut failure = None;
        for (done, error) in results {
            registered.extend(done);
            if let Some(e) = error {
                failure.get_or_insert(e);
            }
        }
        let guard = PinnedPoolGuard {
            ordinal,
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

/// The pieces one pinning thread registered, and the error that stopped it, if any.
type Registered = (Vec<(usize, usize)>, Option<GpuError>);

fn register_pieces(ordinal: i32, mine: &[(usize, usize)]) -> Registered {
    let mut done = Vec::new();
    let api = match set_device(ordinal).and_then(|()| api()) {
        Ok(a) => a,
        Err(e) => return (done, Some(e)),
    };
    for &(ptr, len) in mine {
        let flags = super::sys::hipHostRegisterPortable | super::sys::hipHostRegisterMapped;
        // SAFETY: [ptr, ptr+len) lies inside the pool's mapping, which the caller keeps alive;
        // pieces are disjoint.
        let r = unsafe { (api.hipHostRegister)(ptr as *mut std::ffi::c_void, len, flags) };
        if let Err(e) = check("hipHostRegister", r) {
            return (done, Some(e));
        }
        done.push((ptr, len));
    }
    (done, None)
}

/// Keeps the pool registered with the runtime.
#[derive(Debug)]
struct PinnedPoolGuard {
    ordinal: i32,
    pieces: Vec<(usize, usize)>,
    _pool: Arc<PoolMemory>,
}

impl PinnedPool for PinnedPoolGuard {}

impl Drop for PinnedPoolGuard {
    fn drop(&mut self) {
        let api = match set_device(self.ordinal).and_then(|()| api()) {
            Ok(a) => a,
            Err(e) => return release_failed("the pinned pool", e),
        };
        for &(ptr, _) in &self.pieces {
            // SAFETY: each piece was registered by `pin_pool` and is unregistered once; the pool
            // mapping outlives this guard (it holds an Arc to it).
            let r = unsafe { (api.hipHostUnregister)(ptr as *mut std::ffi::c_void) };
            if let Err(e) = check("hipHostUnregister", r) {
                release_failed("a pinned pool piece", e);
            }
        }
    }
}

/// State shared by a device and everything imported on it.
#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) label: String,
    pub(crate) ordinal: i32,
    /// One mapping per allocation: a second registration of the same allocation shares the
    /// first one's mapping (HIP, like CUDA, maps an allocation once per process).
    ipc: Mutex<HashMap<[u8; IPC_HANDLE_BYTES], Weak<IpcMemory>>>,
}

impl DeviceInner {
    /// Makes this device current on the calling thread.
    pub(crate) fn make_current(&self) -> Result<(), GpuError> {
        set_device(self.ordinal)
    }
}

/// Client memory imported on a HIP GPU, however it was shared.
#[derive(Debug)]
pub enum HipMemory {
    /// A range of an allocation opened by legacy IPC handle.
    Ipc(IpcRange),
    /// VMM chunks imported by descriptor and mapped into one range.
    Vmm(VmmImport),
}

impl HipMemory {
    /// Device address of `offset` within the KV range, checked for `len` bytes.
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<DevicePtr, GpuError> {
        match self {
            HipMemory::Ipc(r) => r.device_ptr(offset, len),
            HipMemory::Vmm(v) => v.device_ptr(offset, len),
        }
    }

    pub(crate) fn device(&self) -> &Arc<DeviceInner> {
        match self {
            HipMemory::Ipc(r) => r.device(),
            HipMemory::Vmm(v) => v.device(),
        }
    }
}

/// A registration on a HIP GPU: its imported allocations and event ring.
#[derive(Debug)]
pub struct HipImports {
    /// The allocations, in registration order.
    pub memories: Vec<HipMemory>,
    /// Both sides' interprocess events, when the client sent any.
    pub events: Option<HipEvents>,
}

/// One GPU.
#[derive(Debug)]
pub struct HipDevice {
    inner: Arc<DeviceInner>,
}

impl HipDevice {
    /// A short name for logs and metrics.
    pub fn label(&self) -> String {
        self.inner.label.clone()
    }

    /// Imports a registration's allocations and opens its event ring.
    pub fn import(
        &self,
        sources: Vec<ImportSource>,
        client_events: &[[u8; IPC_HANDLE_BYTES]],
        server_slots: usize,
    ) -> Result<HipImports, GpuError> {
        let memories = sources
            .into_iter()
            .map(|s| self.import_one(s))
            .collect::<Result<Vec<_>, _>>()?;
        let events = if client_events.is_empty() {
            None
        } else {
            Some(HipEvents::open(
                self.inner.clone(),
                client_events,
                server_slots,
            )?)
        };
        Ok(HipImports { memories, events })
    }

    fn import_one(&self, source: ImportSource) -> Result<HipMemory, GpuError> {
        match source {
            ImportSource::CudaIpc {
                handle,
                offset_bytes,
                size_bytes,
            } => {
                let mut cache = self.inner.ipc.lock();
                if let Some(m) = cache.get(&handle).and_then(Weak::upgrade) {
                    return m.with_range(offset_bytes, size_bytes).map(HipMemory::Ipc);
                }
                let m = Arc::new(IpcMemory::open(self.inner.clone(), handle)?);
                cache.retain(|_, w| w.strong_count() > 0);
                cache.insert(handle, Arc::downgrade(&m));
                m.with_range(offset_bytes, size_bytes).map(HipMemory::Ipc)
            }
            ImportSource::CudaVmm {
                chunks,
                offset_bytes,
                size_bytes,
            } => Ok(HipMemory::Vmm(VmmImport::import(
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

    /// Starts the copy engine, making the device current on the calling thread.
    pub fn copy_engine(&self, pool: Arc<PoolMemory>) -> Result<HipEngine, GpuError> {
        HipEngine::new(self.inner.clone(), pool)
    }
}

/// Formats a UUID for logs and errors. On AMD GPUs `hipDeviceGetUuid` gives sixteen ASCII
/// characters (the unique id `rocm-smi --showuniqueid` prints), shown as such; on HIP's NVIDIA
/// platform it gives NVIDIA's UUID, shown as nvidia-smi does.
pub fn format_uuid(u: &[u8; 16]) -> String {
    if u.iter().all(|b| b.is_ascii_alphanumeric()) {
        return format!("GPU-{}", String::from_utf8_lossy(u));
    }
    crate::device::format_uuid(u)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amd_uuids_print_as_their_unique_id_and_nvidia_ones_like_nvidia_smi() {
        // ROCm's hipDeviceGetUuid: sixteen ASCII characters, as rocm-smi --showuniqueid.
        assert_eq!(format_uuid(b"7b32ac5a1c2d6b1f"), "GPU-7b32ac5a1c2d6b1f");
        // HIP's NVIDIA platform: NVIDIA's binary UUID.
        let u = [
            0x3f, 0x2a, 0x1b, 0x0c, 0xde, 0xad, 0xbe, 0xef, 0, 1, 2, 3, 4, 5, 6, 7,
        ];
        assert_eq!(format_uuid(&u), "GPU-3f2a1b0c-dead-beef-0001-020304050607");
    }
}
