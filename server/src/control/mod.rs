//! The control plane: who is connected, what they asked, and the one reply each request gets.
//!
//! - [`router`]: the ZMTP ROUTER on the control port, with what one peer may cost bounded
//!   before any request is decoded; [`refused`]: the connections that never became clients;
//! - [`fdpass`]: the fd socket, where clients share the descriptors a registration claims;
//! - [`session`]: sessions and their registrations;
//! - [`state`]: what every request handler shares;
//! - [`handler`]: from a frame to a request to its reply, and the one place errors become wire
//!   errors ([`error`]);
//! - [`recall`]: prompts remembered for warming a replacement engine;
//! - [`connections`]: sessions open and close with connections, messages go to the handler,
//!   and what outlives its time is reaped.

pub mod connections;
pub mod error;
pub mod fdpass;
pub mod handler;
pub mod recall;
pub mod refused;
pub mod router;
pub mod session;
pub mod state;
