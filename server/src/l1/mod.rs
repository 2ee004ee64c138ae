//! The L1 core: what is stored in the pinned host pool and where its bytes live. Pure logic
//! — no sockets, no threads, no clocks of its own — so every rule here is tested without a
//! server.
//!
//! - [`key`]: what a chunk is called everywhere;
//! - [`geometry`]: from a registered KV layout to the bytes of one chunk and their place in a
//!   page (logical vs physical);
//! - [`pool`]: pages carved from slabs, per page size (where bytes live);
//! - [`numa`]: which memory node backs which slabs, on machines with several;
//! - [`evict`]: the eviction policies;
//! - [`events`]: the removal feed clients mirror;
//! - [`presence`]: the presence filter clients on this host read (the one file L1 maps);
//! - [`cache`]: the index over the pool — entry states, lookup pins and holds, eviction, and
//!   the hand-over of victims to the disk tier;
//! - [`handle`]: [`L1`], the one handle the rest of kvd holds — the cache behind its lock, the
//!   pool's memory, its growth.

pub mod cache;
pub mod events;
pub mod evict;
pub mod geometry;
pub mod handle;
pub mod key;
pub mod numa;
pub mod pool;
pub mod presence;

pub use handle::{Growth, L1};
pub use key::Key;
