//! The GPU backends written once. [`Runtime`] is the set of driver operations kvd uses, with one
//! implementation per runtime ([`crate::cuda::Cuda`], [`crate::hip::Hip`]) holding the raw calls;
//! everything that owns a driver object is written here, generic over the runtime, in cudarc's
//! shape: raw calls → checked `Result` functions (the trait) → owning types whose `Drop`
//! releases what they hold.
//!
//! kvd's side: [`Backend`] finds GPUs by UUID and pins the pool (`pin`); a [`GpuDevice`]
//! imports a registration ([`GpuImports`]: allocations by legacy IPC handle, deduplicated per
//! allocation, or VMM chunks by descriptor, and an interprocess [`EventRing`]) and runs one
//! [`GpuEngine`]. The client's side (the Python connector, GPU tests): [`client`], [`buffers`].
//!
//! Files depend downwards only: `api` ← `ctx` ← `ipc`, `vmm`, `events` ← `imports` ← `engine` ←
//! `device`; `client` ← `buffers`.

pub mod api;
pub mod buffers;
pub mod client;
mod ctx;
mod device;
mod engine;
mod events;
mod imports;
mod ipc;
mod pin;
mod vmm;

pub use api::Runtime;
pub(crate) use ctx::release_handle as release_vmm_handle;
pub use device::{Backend, DeviceInfo, GpuDevice};
pub use engine::{batch_fallbacks, GpuCompletion, GpuEngine, MAX_BATCH, PIPELINE_BYTES};
pub use events::EventRing;
pub use imports::{GpuImports, GpuMemory};
pub use ipc::IpcRange;
pub use vmm::VmmImport;

/// A generic GPU value that can say which runtime it belongs to (for the dispatch layer's
/// errors and logs).
pub trait OfRuntime {
    /// [`Runtime::NAME`] of the value's runtime.
    const RUNTIME_NAME: &'static str;
}

impl<R: Runtime> OfRuntime for GpuImports<R> {
    const RUNTIME_NAME: &'static str = R::NAME;
}

impl<R: Runtime> OfRuntime for GpuEngine<R> {
    const RUNTIME_NAME: &'static str = R::NAME;
}

impl<R: Runtime> OfRuntime for Backend<R> {
    const RUNTIME_NAME: &'static str = R::NAME;
}
