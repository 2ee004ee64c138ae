//! The process's life: its flags, binding every socket before any slow work, growing the pool
//! in the background, serving, and on SIGTERM draining and releasing everything in reverse.
//!
//! - [`config`]: `kvd serve`'s flags and the settings they resolve to;
//! - [`grow`]: making the L1 pool ready in steps while kvd serves;
//! - [`health`]: what `/healthz` says;
//! - [`server`]: bind, serve, drain.

pub mod config;
pub mod grow;
pub mod health;
pub mod server;
