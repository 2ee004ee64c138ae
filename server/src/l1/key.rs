//! What a stored chunk is keyed by: the one name every part of kvd gives a chunk (the index,
//! the removal feed, the tiers below L1).

/// What a stored chunk is keyed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// Model and layout fingerprint.
    pub fingerprint: u64,
    /// Hash of the cache salt.
    pub salt: u64,
    /// KV shard.
    pub shard: u32,
    /// Chained chunk hash.
    pub hash: u128,
}

impl Key {
    /// A 64-bit digest of the whole key, for policies that remember evicted keys.
    pub fn digest(&self) -> u64 {
        let h = (self.hash as u64) ^ ((self.hash >> 64) as u64).rotate_left(29);
        let m = h
            ^ self.fingerprint.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ self.salt.rotate_left(17)
            ^ u64::from(self.shard).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
        m ^ (m >> 31)
    }
}
