//! Chunk keys: `h_i = xxh3_128(h_{i-1} ‖ tokens_i ‖ extras overlapping chunk i)`, seeded by
//! the request's namespace (LoRA, for instance). Deterministic across processes and
//! independent of PYTHONHASHSEED, so every vLLM instance on a node computes the same keys and
//! shares one cache; chained, so a chunk only hits after the same whole prefix.
//!
//! An extra is a span of token positions with an identity — a multimodal input's hash over its
//! placeholder tokens — folded into every chunk it overlaps, with its offset relative to the
//! chunk, so two requests with the same placeholder tokens but different images never share a
//! key.

use xxhash_rust::xxh3::Xxh3;

const DOMAIN: &[u8] = b"kvd-chunk-v1";

/// A span of token positions with an identity, folded into every chunk it overlaps:
/// `(start, length, identity)`.
pub type Extra = (u64, u64, Vec<u8>);

/// Chained keys of the full chunks of `tokens` (a partial last chunk has none); `seed`
/// namespaces the chain. `chunk_tokens` must be above zero.
pub fn chunk_hashes(
    tokens: &[u32],
    chunk_tokens: usize,
    extras: &[Extra],
    seed: u128,
) -> Vec<u128> {
    assert!(chunk_tokens > 0, "chunk_tokens must be above zero");
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
        let a = chunk_hashes(&toks, 8, &[], 0);
        assert_eq!(a.len(), 5);
        assert_eq!(a, chunk_hashes(&toks, 8, &[], 0));
        let mut other = toks.clone();
        other[0] = 99;
        let b = chunk_hashes(&other, 8, &[], 0);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x != y),
            "a change in chunk 0 changes every later key"
        );
        let img = chunk_hashes(&toks, 8, &[(10, 12, b"img-1".to_vec())], 0);
        let img2 = chunk_hashes(&toks, 8, &[(10, 12, b"img-2".to_vec())], 0);
        assert_eq!(img[0], a[0], "chunk 0 does not overlap the image");
        assert_ne!(img[1], a[1]);
        assert_ne!(img[1], img2[1]);
        assert_ne!(
            chunk_hashes(&toks, 8, &[], 1)[0],
            a[0],
            "the seed namespaces the chain"
        );
    }

    /// Keys outlive a kvd version (the disk tier keeps them; every engine on a node must agree),
    /// so a change to how they are computed must not change them: these are the values of the
    /// code as of 0807e8b.
    #[test]
    fn keys_are_those_of_earlier_versions() {
        let toks: Vec<u32> = (0..600u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        let plain = chunk_hashes(&toks, 256, &[], 0);
        let seeded = chunk_hashes(&toks, 256, &[(250, 20, b"image".to_vec())], 7);
        assert_eq!(
            plain,
            [
                0x4fb788beaa5857637dc849c0e46959bc,
                0x35cc23d28e11712d631cb7932fe0d561
            ]
        );
        assert_eq!(
            seeded,
            [
                0x73156a64d3742b0c460165650ab459da,
                0xc81a8945930480970c5ac9666fc4e82e
            ]
        );
    }
}
