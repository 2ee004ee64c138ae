//! The HIP backend, for AMD GPUs (MI300X, MI355X) under ROCm: the CUDA backend's shape and
//! guarantees on HIP's runtime API, loaded at run time so that one kvd binary serves NVIDIA
//! and AMD nodes and building it needs no ROCm. Layered like cudarc: raw declarations
//! ([`sys`]), a `result` layer ([`driver`]) that turns them into `Result`s, and owning types
//! whose `Drop` releases what they hold.
//!
//! kvd's side: [`HipBackend`] finds GPUs by UUID and pins the pool (`hipHostRegister`, in
//! pieces); a device imports a registration ([`HipImports`]: allocations by legacy IPC handle,
//! deduplicated per allocation, or VMM chunks by descriptor, and an interprocess event ring) and
//! runs one copy engine on the DMA engines. The client's side: [`client`].
//!
//! The same code runs on an NVIDIA GPU through HIP's NVIDIA platform: `scripts/hip-nvidia/`
//! builds a library that exports the HIP entry points kvd loads and forwards each one to CUDA
//! the way HIP's `nvidia_detail` headers do. That is how kvd's HIP code is tested without an AMD
//! GPU; it cannot say anything about AMD's driver or SDMA engines.

pub mod abi;
pub mod client;
mod device;
pub mod driver;
mod engine;
mod events;
mod ipc;
pub mod sys;
mod vmm;

pub use device::{format_uuid, DeviceInfo, HipBackend, HipDevice, HipImports, HipMemory};
pub use driver::{available, library};
pub use engine::{HipCompletion, HipEngine};
pub use events::HipEvents;
pub use ipc::IpcRange;
pub use vmm::VmmImport;
