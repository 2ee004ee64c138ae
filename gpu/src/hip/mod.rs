//! The HIP backend, for AMD GPUs (MI300X, MI355X) under ROCm, loaded at run time so that one kvd
//! binary serves NVIDIA and AMD nodes and building it needs no ROCm. This module holds only the
//! raw side: declarations of the entry points ([`sys`], checked against ROCm's headers by
//! [`abi`]), the `result` layer ([`driver`]) and [`Hip`], the [`crate::runtime::Runtime`]
//! implementation; the owning types are the generic ones of [`crate::runtime`], named here for
//! HIP. Copies run on the DMA (SDMA) engines.
//!
//! The same code runs on an NVIDIA GPU through HIP's NVIDIA platform: `scripts/hip-nvidia/`
//! builds a library that exports the HIP entry points kvd loads and forwards each one to CUDA
//! the way HIP's `nvidia_detail` headers do. That is how kvd's HIP code is tested without an AMD
//! GPU; it cannot say anything about AMD's driver or SDMA engines.

pub mod abi;
pub mod driver;
mod runtime;
pub mod sys;

pub use driver::{available, library};
pub use runtime::{Hip, HipContext};

pub use crate::runtime::DeviceInfo;
use crate::runtime::{
    Backend, EventRing, GpuCompletion, GpuDevice, GpuEngine, GpuImports, GpuMemory, Runtime,
};

/// The HIP runtime as kvd uses it.
pub type HipBackend = Backend<Hip>;
/// One GPU driven through HIP.
pub type HipDevice = GpuDevice<Hip>;
/// A registration imported on a HIP GPU.
pub type HipImports = GpuImports<Hip>;
/// Client memory imported on a HIP GPU.
pub type HipMemory = GpuMemory<Hip>;
/// A registration's HIP interprocess events.
pub type HipEvents = EventRing<Hip>;
/// A HIP GPU's copy engine.
pub type HipEngine = GpuEngine<Hip>;
/// A submitted HIP copy.
pub type HipCompletion = GpuCompletion<Hip>;

/// Formats a UUID for logs and errors: an AMD GPU's unique id as such, an NVIDIA UUID (HIP's
/// NVIDIA platform) as nvidia-smi does.
pub fn format_uuid(u: &[u8; 16]) -> String {
    Hip::format_uuid(u)
}
