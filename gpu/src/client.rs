//! The client side of a GPU backend, as the Python connector and the GPU tests use it: one API
//! over CUDA and HIP, chosen by [`GpuApi`]. The two differ only in which runtime they call; what
//! they produce — IPC handles, VMM chunk descriptors, event handles — goes into the same wire
//! messages, since kvd matches GPUs by UUID and imports with whichever backend it found.

use std::os::fd::OwnedFd;

use crate::error::GpuError;

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

/// Which GPU runtime a client uses: the one its PyTorch was built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuApi {
    /// NVIDIA's CUDA driver API.
    Cuda,
    /// AMD's HIP runtime (ROCm), or HIP's NVIDIA platform in kvd's tests.
    Hip,
}

impl GpuApi {
    /// `cuda` or `hip`, as the connector names devices.
    pub fn name(self) -> &'static str {
        match self {
            GpuApi::Cuda => "cuda",
            GpuApi::Hip => "hip",
        }
    }

    /// The API named `cuda` or `hip`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "cuda" => Some(GpuApi::Cuda),
            "hip" => Some(GpuApi::Hip),
            _ => None,
        }
    }
}

fn not_built(api: GpuApi) -> GpuError {
    GpuError::Unavailable(format!(
        "this build of kvd has no {} backend (cargo feature {})",
        api.name(),
        api.name()
    ))
}

/// Dispatches one call to the CUDA or HIP client module.
macro_rules! dispatch {
    ($api:expr, $f:ident($($arg:expr),*)) => {
        match $api {
            #[cfg(feature = "cuda")]
            GpuApi::Cuda => crate::cuda::client::$f($($arg),*),
            #[cfg(feature = "hip")]
            GpuApi::Hip => crate::hip::client::$f($($arg),*),
            #[allow(unreachable_patterns)]
            other => Err(not_built(other)),
        }
    };
}

/// Whether the runtime can be loaded here, and if not, why.
pub fn available(api: GpuApi) -> Result<(), GpuError> {
    match api {
        #[cfg(feature = "cuda")]
        GpuApi::Cuda => crate::cuda::available(),
        #[cfg(feature = "hip")]
        GpuApi::Hip => crate::hip::available(),
        #[allow(unreachable_patterns)]
        other => Err(not_built(other)),
    }
}

/// Describes the allocation holding `ptr`.
pub fn describe(api: GpuApi, ptr: u64) -> Result<Pointer, GpuError> {
    dispatch!(api, describe(ptr))
}

/// Exports the legacy IPC handle of an allocation base ([`GpuError::VmmMemory`] for VMM memory).
pub fn ipc_handle(api: GpuApi, p: &Pointer) -> Result<[u8; 64], GpuError> {
    dispatch!(api, ipc_handle(p))
}

/// The physical chunks behind a VMM range, as (chunk base, chunk size).
pub fn vmm_chunks(
    api: GpuApi,
    ordinal: i32,
    ptr: u64,
    size: u64,
) -> Result<Vec<(u64, u64)>, GpuError> {
    dispatch!(api, vmm_chunks(ordinal, ptr, size))
}

/// Exports VMM chunks as POSIX descriptors.
pub fn export_chunks(
    api: GpuApi,
    ordinal: i32,
    chunks: &[(u64, u64)],
    first_base: u64,
) -> Result<Vec<ExportedChunk>, GpuError> {
    dispatch!(api, export_chunks(ordinal, chunks, first_base))
}

/// Free and total memory of a device, in bytes.
pub fn mem_info(api: GpuApi, ordinal: i32) -> Result<(u64, u64), GpuError> {
    dispatch!(api, mem_info(ordinal))
}

/// The client's interprocess events, of one runtime.
#[derive(Debug)]
pub enum ClientEvents {
    /// CUDA events.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::client::ClientEvents),
    /// HIP events.
    #[cfg(feature = "hip")]
    Hip(crate::hip::client::ClientEvents),
}

impl ClientEvents {
    /// Creates `n` interprocess events on device `ordinal`.
    pub fn new(api: GpuApi, ordinal: i32, n: usize) -> Result<Self, GpuError> {
        match api {
            #[cfg(feature = "cuda")]
            GpuApi::Cuda => crate::cuda::client::ClientEvents::new(ordinal, n).map(Self::Cuda),
            #[cfg(feature = "hip")]
            GpuApi::Hip => crate::hip::client::ClientEvents::new(ordinal, n).map(Self::Hip),
            #[allow(unreachable_patterns)]
            other => Err(not_built(other)),
        }
    }

    /// IPC handles, in slot order, for the registration.
    pub fn handles(&self) -> &[[u8; 64]] {
        match *self {
            #[cfg(feature = "cuda")]
            Self::Cuda(ref e) => e.handles(),
            #[cfg(feature = "hip")]
            Self::Hip(ref e) => e.handles(),
        }
    }

    /// Records event `slot` on `stream` (PyTorch's current stream handle).
    pub fn record(&self, slot: usize, stream: u64) -> Result<(), GpuError> {
        match *self {
            #[cfg(feature = "cuda")]
            Self::Cuda(ref e) => e.record(slot, stream),
            #[cfg(feature = "hip")]
            Self::Hip(ref e) => e.record(slot, stream),
        }
    }
}

/// kvd's events as the client sees them, of one runtime.
#[derive(Debug)]
pub enum ServerEvents {
    /// CUDA events.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::client::ServerEvents),
    /// HIP events.
    #[cfg(feature = "hip")]
    Hip(crate::hip::client::ServerEvents),
}

impl ServerEvents {
    /// Opens kvd's events on device `ordinal`.
    pub fn open(api: GpuApi, ordinal: i32, handles: &[[u8; 64]]) -> Result<Self, GpuError> {
        match api {
            #[cfg(feature = "cuda")]
            GpuApi::Cuda => {
                crate::cuda::client::ServerEvents::open(ordinal, handles).map(Self::Cuda)
            }
            #[cfg(feature = "hip")]
            GpuApi::Hip => crate::hip::client::ServerEvents::open(ordinal, handles).map(Self::Hip),
            #[allow(unreachable_patterns)]
            other => Err(not_built(other)),
        }
    }

    /// Whether the copy announced on `slot` has completed (never blocks).
    pub fn query(&self, slot: u16) -> Result<bool, GpuError> {
        match *self {
            #[cfg(feature = "cuda")]
            Self::Cuda(ref e) => e.query(slot),
            #[cfg(feature = "hip")]
            Self::Hip(ref e) => e.query(slot),
        }
    }

    /// Makes `stream` wait for the copy announced on `slot`, without blocking the host.
    pub fn stream_wait(&self, slot: u16, stream: u64) -> Result<(), GpuError> {
        match *self {
            #[cfg(feature = "cuda")]
            Self::Cuda(ref e) => e.stream_wait(slot, stream),
            #[cfg(feature = "hip")]
            Self::Hip(ref e) => e.stream_wait(slot, stream),
        }
    }

    /// Blocks until the copy announced on `slot` has completed.
    pub fn synchronize(&self, slot: u16) -> Result<(), GpuError> {
        match *self {
            #[cfg(feature = "cuda")]
            Self::Cuda(ref e) => e.synchronize(slot),
            #[cfg(feature = "hip")]
            Self::Hip(ref e) => e.synchronize(slot),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_names_round_trip_and_unknown_names_are_refused() {
        for api in [GpuApi::Cuda, GpuApi::Hip] {
            assert_eq!(GpuApi::from_name(api.name()), Some(api));
        }
        assert_eq!(GpuApi::from_name("rocm"), None);
    }
}
