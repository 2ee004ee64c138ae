//! The small vLLM-shaped cache the tier tests use, and its chunks: 32-token chunks of two
//! 16-token blocks, keyed as clients key them.

use super::{chain_from, HostKv, Rng};

pub const CHUNK_TOKENS: usize = 32;
/// Blocks per chunk for the cache below (16-token blocks).
pub const PER: u32 = 2;

/// A small vLLM-shaped cache: 64 blocks of 16 tokens, 2 layers, 2 heads (4 KiB chunks).
pub fn cache(seed: u64) -> HostKv {
    let kv = HostKv::vllm("BLNHC", 2, 64, 2, 16, 16, 2);
    kv.fill_random(&mut Rng(seed));
    kv
}

/// The keys of `n` chunks of consecutive tokens from `first_token`.
pub fn hashes(first_token: u32, n: usize) -> Vec<u128> {
    chain_from(first_token, n, CHUNK_TOKENS)
}

/// Chunk `i` of a request lies in blocks `first_block + PER*i ..`.
pub fn blocks_of(first_block: u32, n: usize) -> Vec<Vec<u32>> {
    (0..n as u32)
        .map(|i| (0..PER).map(|b| first_block + i * PER + b).collect())
        .collect()
}
