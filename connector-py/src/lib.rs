//! `kvd._native`: the Rust half of the `kvd` Python package. It speaks kvd's protocol through
//! kvd-proto's client and wire types, the ones the server is built from (so the two ends cannot drift), computes chunk hashes,
//! and does the CUDA driver work a worker needs — describing and exporting its KV allocation,
//! creating and polling interprocess events — without touching PyTorch internals.
//!
//! Blocking calls release the GIL. Errors map to Python exceptions in one place, [`errors`].
#![forbid(unsafe_code)]
// Python-facing functions take keyword arguments; their Rust signatures mirror them.
#![allow(clippy::too_many_arguments)]

mod client;
mod errors;
mod hashing;
mod host;
mod plan;
mod presence;
mod register;
mod runtime;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("PROTOCOL_VERSION", kvd_proto::wire::PROTOCOL_VERSION)?;
    outcomes(m)?;
    errors::register(m)?;
    m.add_class::<client::Client>()?;
    m.add_class::<client::Pending>()?;
    m.add_class::<register::Registration>()?;
    m.add_class::<host::HostBuffer>()?;
    m.add_function(wrap_pyfunction!(hashing::chunk_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(register::cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(register::gpu_available, m)?)?;
    m.add_function(wrap_pyfunction!(register::describe_pointer, m)?)?;
    m.add_function(wrap_pyfunction!(register::device_memory, m)?)?;
    Ok(())
}

/// The codes store and retrieve outcomes come as, and the block id a retrieve leaves alone,
/// from the wire types themselves.
fn outcomes(m: &Bound<'_, PyModule>) -> PyResult<()> {
    use kvd_proto::wire::{RetrieveOutcome, StoreOutcome, SKIP_BLOCK};
    m.add("STORED", StoreOutcome::Stored as u8)?;
    m.add("ALREADY_STORED", StoreOutcome::AlreadyStored as u8)?;
    m.add("REFUSED_POOL_FULL", StoreOutcome::RefusedPoolFull as u8)?;
    m.add("SKIPPED", StoreOutcome::Skipped as u8)?;
    m.add("LOADED", RetrieveOutcome::Loaded as u8)?;
    m.add("MISSING", RetrieveOutcome::Missing as u8)?;
    m.add("SKIP", SKIP_BLOCK)?;
    Ok(())
}
