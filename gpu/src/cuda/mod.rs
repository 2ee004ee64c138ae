//! The CUDA backend, on the driver API through cudarc's raw bindings, loaded at run time: the
//! same binary runs on machines without a GPU and says so instead of failing. This module holds
//! only the raw calls — the `result` layer ([`driver`]) and [`Cuda`], the
//! [`crate::runtime::Runtime`] implementation — and names the generic owning types of
//! [`crate::runtime`] for CUDA: [`CudaBackend`] finds GPUs by UUID and pins the pool; a
//! [`CudaDevice`] imports a registration ([`CudaImports`]) and runs one [`CudaEngine`].

pub mod driver;
mod runtime;

pub use driver::available;
pub use runtime::Cuda;

pub use crate::runtime::{batch_fallbacks, DeviceInfo};
use crate::runtime::{
    Backend, EventRing, GpuCompletion, GpuDevice, GpuEngine, GpuImports, GpuMemory, Runtime,
};

/// The CUDA driver as kvd uses it.
pub type CudaBackend = Backend<Cuda>;
/// One GPU driven through CUDA.
pub type CudaDevice = GpuDevice<Cuda>;
/// A registration imported on a CUDA GPU.
pub type CudaImports = GpuImports<Cuda>;
/// Client memory imported on a CUDA GPU.
pub type CudaMemory = GpuMemory<Cuda>;
/// A registration's CUDA interprocess events.
pub type CudaEvents = EventRing<Cuda>;
/// A CUDA GPU's copy engine.
pub type CudaEngine = GpuEngine<Cuda>;
/// A submitted CUDA copy.
pub type CudaCompletion = GpuCompletion<Cuda>;

/// Formats a UUID the way nvidia-smi does.
pub fn format_uuid(u: &[u8; 16]) -> String {
    Cuda::format_uuid(u)
}
