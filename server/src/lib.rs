//! kvd's server. What clients share with it (wire types, ZMTP framing, the client) is
//! `kvd-proto`; all `unsafe` lives in `kvd-gpu`. Its modules are wings, each using only the
//! ones listed before it (`tests/layers.rs` checks it):
//!
//! - [`config`]: the flag checks every part uses; imports nothing of the server;
//! - [`l1`]: the L1 core — pages, the index, pins and holds, eviction, the removal feed,
//!   geometry, NUMA — and [`l1::L1`], the one handle the rest holds;
//! - [`ops`]: metrics, the HTTP responder, the shared accept loop, cgroup;
//! - [`data`]: the data plane — devices and their copy workers;
//! - [`tiers`]: below L1, the disk and L2 side by side, and the chain that asks them in turn;
//! - [`control`]: the control plane — router, fd socket, sessions, the handler;
//! - [`life`]: the process's life — flags and settings, pool growth, `/healthz`, bind, serve
//!   and drain.
#![forbid(unsafe_code)]

pub mod config;
pub mod control;
pub mod data;
pub mod l1;
pub mod life;
pub mod ops;
pub mod tiers;

// The protocol both ends compile, under the names the server's modules use.
use kvd_proto::{wire, zmtp};
