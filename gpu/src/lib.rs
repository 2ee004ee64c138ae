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
//! - [`runtime`]: the GPU backends written once, generic over a [`runtime::Runtime`] — CUDA's
//!   ([`cuda`]) and HIP's ([`hip`]) hold only the raw calls;
//! - [`client`]: the client side of a GPU runtime, for the Python connector and the GPU tests;
//! - [`copy`]: copy runs and their coalescing; [`types`]: what the dispatch layer and every
//!   backend share.
//!
//! Modules depend downwards: `error`, `layout`, `memory`, `copy`, `types` ← `host`, `runtime` ←
//! `cuda`, `hip` ← `device`, `client`. The wire protocol and everything else — pages, keys,
//! pins — is safe code in `kvd-proto` and `kvd-server`.

pub mod client;
pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod error;
#[cfg(feature = "hip")]
pub mod hip;
pub mod host;
pub mod layout;
pub mod memory;
#[cfg(any(feature = "cuda", feature = "hip"))]
pub mod runtime;
pub mod shared;
pub mod types;

pub use copy::{CopyRun, Direction, SubmitTimes, Transfer};
pub use device::{Completion, CopyEngine, CopyJob, Device, GpuBackend, Imports};
pub use error::{release_errors, GpuError};
pub use layout::PoolLayout;
pub use memory::{PoolMemory, PoolPage, PoolSpan, TouchProgress};
pub use types::{ImportSource, PinnedPool, PoolPin, IPC_HANDLE_BYTES};
