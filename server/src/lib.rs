//! kvd's server: configuration, the ZMQ control plane, the L1 pool and its index, the copy
//! workers, HTTP health and metrics, and shutdown. All `unsafe` lives in `kvd-gpu`.
#![forbid(unsafe_code)]

mod accept;
pub mod cache;
pub mod client;
pub mod config;
pub mod copier;
pub mod devices;
pub mod evict;
pub mod fdpass;
pub mod geometry;
pub mod handler;
pub mod http;
pub mod metrics;
pub mod pool;
pub mod server;
pub mod session;
pub mod state;
pub mod wire;
pub mod zmtp;
