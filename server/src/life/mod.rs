//! The process's life: its flags, binding every socket before any slow work, growing the pool
//! in the background, serving, and on SIGTERM draining and releasing everything in reverse.
//!
//! - [`flags`]: `kvd serve`'s flags; [`machine`]: what the machine offers;
//!   [`pool_size`]: the pool's size rule; [`config`]: the settings they all resolve to;
//! - [`grow`]: making the L1 pool ready in steps while kvd serves;
//! - [`health`]: what `/healthz` says;
//! - [`server`]: bind, serve, drain.

pub mod config;
pub mod flags;
pub mod grow;
pub mod health;
pub mod machine;
pub mod pool_size;
pub mod server;
