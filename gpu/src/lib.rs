//! kvd's device layer, and the only crate of kvd with `unsafe` code.
//!
//! It owns what touches raw memory or a GPU driver:
//! - [`layout::PoolLayout`]: the pool's size and pinned pieces, which pinning, pages and copy
//!   coalescing all cut along;
//! - [`memory::PoolMemory`]: the L1 pool's anonymous mapping and its parallel first touch;
//! - [`device`]: what the server programs against (import client memory, run copies), one enum
//!   variant per backend;
//! - [`host`]: the backend that treats a client's sealed memfd as device memory, so that every
//!   server path runs in CI between real processes;
//! - [`copy`]: copy runs and their coalescing.
//!
//! Everything else — pages, keys, pins, the protocol — is safe code in `kvd-server`.

pub mod client;
pub mod copy;
pub mod device;
pub mod error;
pub mod host;
pub mod layout;
pub mod memory;

pub use copy::{CopyJob, CopyRun, Direction};
pub use device::{
    Completion, CopyEngine, Device, GpuBackend, ImportSource, Imports, PinnedPool, PoolPin,
};
pub use error::{release_errors, GpuError};
pub use layout::PoolLayout;
pub use memory::{PoolMemory, PoolPage, PoolSpan, TouchProgress};
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "hip")]
pub mod hip;
