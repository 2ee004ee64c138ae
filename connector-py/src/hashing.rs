//! `kvd.chunk_hashes`: the chunk keys of `kvd_proto::keys`, with the GIL released.

use pyo3::prelude::*;

/// Chained hashes of the full chunks of `tokens`.
///
/// `extras` are `(start, length, identity)` spans; `seed` namespaces the chain.
#[pyfunction]
#[pyo3(signature = (tokens, chunk_tokens, extras = Vec::new(), seed = 0))]
pub(crate) fn chunk_hashes(
    py: Python<'_>,
    tokens: Vec<u32>,
    chunk_tokens: usize,
    extras: Vec<kvd_proto::keys::Extra>,
    seed: u128,
) -> PyResult<Vec<u128>> {
    if chunk_tokens == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "chunk_tokens must be above zero",
        ));
    }
    Ok(py.detach(|| kvd_proto::keys::chunk_hashes(&tokens, chunk_tokens, &extras, seed)))
}
