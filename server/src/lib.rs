//! kvd's server: configuration, the ZMQ ROUTER and request dispatch, the L1 pool and its index,
//! the copy workers, HTTP health and metrics, and shutdown. What clients share with it (wire
//! types, ZMTP framing, the client) is `kvd-proto`; all `unsafe` lives in `kvd-gpu`.
#![forbid(unsafe_code)]

pub mod control;
pub mod data;
pub mod l1;
pub mod life;
pub mod ops;
pub mod tiers;

// The protocol both ends compile, under the names the server's modules use.
use kvd_proto::{wire, zmtp};
