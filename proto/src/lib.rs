//! What kvd and every client of it compile, so the two ends cannot drift: the wire types and
//! their bounded codec ([`wire`]), ZMTP 3.1 framing and the DEALER side ([`zmtp`]), the async
//! client ([`client`]) that tests, benches and the `kvd._native` Python module use, the fd
//! socket's format and sender ([`fdpass`]), and the chunk keys ([`keys`]).
//!
//! The server (`kvd-server`) adds the ROUTER, the pool and everything else; a client needs none
//! of it.
#![forbid(unsafe_code)]

pub mod client;
pub mod fdpass;
pub mod keys;
pub mod layouts;
pub mod presence;
pub mod wire;
pub mod zmtp;
