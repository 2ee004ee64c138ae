//! The CUDA backend, on the driver API through cudarc's raw bindings, loaded at run time: the
//! same binary runs on machines without a GPU and says so instead of failing. Shaped like
//! cudarc itself: raw `sys` calls, a `result` layer ([`driver`]) that turns them into
//! `Result`s, and owning types whose `Drop` releases what they hold.
//!
//! kvd's side: [`CudaBackend`] finds GPUs by UUID and pins the pool; a device imports a
//! registration ([`CudaImports`]: allocations by legacy IPC handle or VMM descriptors, and an
//! event ring) and runs one copy engine, which takes only CUDA imports. The client's
//! side (the Python connector, GPU tests): [`client`].

pub mod client;
mod device;
pub mod driver;
mod engine;
mod events;
mod ipc;
pub mod vmm;

pub use device::{CudaBackend, CudaDevice, CudaImports, CudaMemory, DeviceInfo};
pub use driver::{available, format_uuid, release_errors};
pub use engine::{batch_fallbacks, CudaCompletion, CudaEngine};
pub use events::CudaEvents;
pub use ipc::IpcRange;
pub use vmm::VmmImport;
