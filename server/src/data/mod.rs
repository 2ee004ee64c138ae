//! The data plane: how bytes move between clients' KV caches and the pool. Logical (which
//! chunks) is [`crate::l1`]'s and transfer (when, and who is answered) is the control plane's;
//! this wing owns the devices and their copy threads.
//!
//! - [`devices`]: the host backend always, a GPU backend when one is present, one copy worker
//!   per device, NUMA-aware;
//! - [`copier`]: a device's copy worker — a lane for stores and one for retrieves, each a named
//!   submitting thread and a completion thread fed by a bounded queue.

pub mod copier;
pub mod devices;
