//! Chunk keys: `h_i = xxh3_128(h_{i-1} ‖ tokens_i ‖ extras overlapping chunk i)`, seeded by
//! the request's namespace (LoRA, for instance). Deterministic across processes and
//! independent of PYTHONHASHSEED, so every vLLM instance on a node computes the same keys and
//! shares one cache; chained, so a chunk only hits after the same whole prefix.
//!
//! An extra is a span of token positions with an identity — a multimodal input's hash over its
//! placeholder tokens — folded into every chunk it overlaps, with its offset relative to the
//! chunk, so two requests with the same placeholder tokens but different images never share a
//! key.

use pyo3::prelude::*;
use xxhash_rust::xxh3::Xxh3;

const DOMAIN: &[u8] = b"kvd-chunk-v1";

/// Chained hashes of the full chunks of `tokens`.
///
/// `extras` are `(start, length, identity)` spans; `seed` namespaces the chain.
#[pyfunction]
#[pyo3(signature = (tokens, chunk_tokens, extras = Vec::new(), seed = 0))]
pub(crate) fn chunk_hashes(
    py: Python<'_>,
    tokens: Vec<u32>,
    chunk_tokens: usize,
    extras: Vec<(u64, u64, Vec<u8>)>,
    seed: u128,
) -> PyResult<Vec<u128>> {
    if chunk_tokens == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "chunk_tokens must be above zero",
        ));
    }
    Ok(py.detach(|| hashes(&tokens, chunk_tokens, &extras, seed)))
}

pub(crate) fn hashes(
    tokens: &[u32],
    chunk_tokens: usize,
    extras: &[(u64, u64, Vec<u8>)],
    seed: u128,
) -> Vec<u128> {
    let mut h = Xxh3::new();
    h.update(DOMAIN);
    h.update(&seed.to_le_bytes());
    let mut prev = h.digest128();
    let mut out = Vec::with_capacity(tokens.len() / chunk_tokens);
    for (i, chunk) in tokens.chunks_exact(chunk_tokens).enumerate() {
        let start = (i * chunk_tokens) as u64;
        let end = start + chunk_tokens as u64;
        let mut h = Xxh3::new();
        h.update(&prev.to_le_bytes());
        for t in chunk {
            h.update(&t.to_le_bytes());
        }
        for (s, len, id) in extras {
            if *s < end && s + len > start {
                // Where the span starts relative to this chunk (negative when it began earlier).
                h.update(&(*s as i64 - start as i64).to_le_bytes());
                h.update(&len.to_le_bytes());
                h.update(&(id.len() as u64).to_le_bytes());
                h.update(id);
            }
        }
        prev = h.digest128();
        out.push(prev);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_deterministic_and_sensitive_to_extras() {
        let toks: Vec<u32> = (0..40).collect();
        let a = hashes(&toks, 8, &[], 0);
        assert_eq!(a.len(), 5);
        assert_eq!(a, hashes(&toks, 8, &[], 0));
        let mut other = toks.clone();
        other[0] = 99;
        let b = hashes(&other, 8, &[], 0);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x != y),
            "a change in chunk 0 changes every later key"
        );
        let img = hashes(&toks, 8, &[(10, 12, b"img-1".to_vec())], 0);
        let img2 = hashes(&toks, 8, &[(10, 12, b"img-2".to_vec())], 0);
        assert_eq!(img[0], a[0], "chunk 0 does not overlap the image");
        assert_ne!(img[1], a[1]);
        assert_ne!(img[1], img2[1]);
        assert_ne!(
            hashes(&toks, 8, &[], 1)[0],
            a[0],
            "the seed namespaces the chain"
        );
    }
}
