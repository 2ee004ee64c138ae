//! kvd's server: configuration, the ZMQ control plane, the L1 pool and its index, the copy
//! workers, HTTP health and metrics, and shutdown. All `unsafe` lives in `kvd-gpu`.
#![forbid(unsafe_code)]

pub mod wire;
pub mod pool;
pub mod zmtp;
pub mod config;
pub mod evict;
pub mod geometry;
