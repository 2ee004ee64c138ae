//! The bytes of one chunk in L2: a fixed header, then the chunk's page exactly as it lies in an
//! L1 page. An L2 is shared by every node and outlives any one kvd, so a value may be truncated
//! (a full server, a cut connection), written by another kvd version, written for another KV
//! layout under a colliding key, damaged — or placed there on purpose by anyone who can write
//! to the L2. The header lets kvd reject each of these before a byte of it reaches an L1 page,
//! and so a GPU.
//!
//! Common part, little-endian (32 bytes): magic `kvdL` (4) · format version u16 · reserved u16 ·
//! layout digest u64 · key tag u64 (xxh3 of the L2 key: a value copied under another key is
//! foreign) · payload length u64. Then:
//! - version 1 (no `--l2-secret-file`): xxh3-64 of the payload (8): detects damage, not
//!   forgery — anyone who can write to the L2 can write a value that passes. xxh3 hashes at
//!   over 10 GB/s per core.
//! - version 2 (with `--l2-secret-file`): a 32-byte keyed BLAKE3 MAC over the common part, the
//!   full L2 key name and the payload. Without the key no one can make a value that opens,
//!   nor move a value to another key (the name is in the MAC, not just its 64-bit tag); a
//!   replay under the same key gives back the bytes kvd wrote there. A kvd with a key rejects
//!   version-1 values (`unauthenticated`) and bad MACs (`forged`); one without a key rejects
//!   version-2 values (`needs_secret`). The cost is measured in `benches/RESULTS.md`.
//!
//! Sealing and opening run on blocking threads, never a tokio worker.

use xxhash_rust::xxh3::xxh3_64;

/// The key of the values' MAC, derived from `--l2-secret-file`.
#[derive(Clone, PartialEq, Eq)]
pub struct MacKey(pub [u8; 32]);

impl std::fmt::Debug for MacKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The header's common part.
const COMMON_BYTES: usize = 32;
/// Header bytes of a version-1 value.
pub const HEADER_V1_BYTES: usize = COMMON_BYTES + 8;
/// Header bytes of a version-2 (MAC'd) value.
pub const HEADER_V2_BYTES: usize = COMMON_BYTES + 32;
const MAGIC: [u8; 4] = *b"kvdL";

/// Why a value was not accepted; each reason is a label of `kvd_l2_rejected_values_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Rejected {
    /// Shorter than its header or than the length it declares.
    #[error("truncated")]
    Truncated,
    /// Not a kvd value, or a format version this kvd does not read.
    #[error("version")]
    Version,
    /// Written for another KV layout or under another key.
    #[error("foreign")]
    Foreign,
    /// Its payload is not one page of this layout.
    #[error("length")]
    Length,
    /// The checksum does not match the payload.
    #[error("corrupt")]
    Corrupt,
    /// This kvd has `--l2-secret-file` and the value carries no MAC.
    #[error("unauthenticated")]
    Unauthenticated,
    /// The MAC does not match: another key, or bytes changed by someone without the key.
    #[error("forged")]
    Forged,
    /// The value carries a MAC and this kvd has no `--l2-secret-file` to check it.
    #[error("needs_secret")]
    NeedsSecret,
}

impl Rejected {
    /// Every reason, for exporting each label at 0.
    pub const ALL: [Rejected; 8] = [
        Rejected::Truncated,
        Rejected::Version,
        Rejected::Foreign,
        Rejected::Length,
        Rejected::Corrupt,
        Rejected::Unauthenticated,
        Rejected::Forged,
        Rejected::NeedsSecret,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Rejected::Truncated => "truncated",
            Rejected::Version => "version",
            Rejected::Foreign => "foreign",
            Rejected::Length => "length",
            Rejected::Corrupt => "corrupt",
            Rejected::Unauthenticated => "unauthenticated",
            Rejected::Forged => "forged",
            Rejected::NeedsSecret => "needs_secret",
        }
    }
}

/// The tag of an L2 key stored in its values' headers.
pub fn key_tag(key: &str) -> u64 {
    xxh3_64(key.as_bytes())
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

/// Seals and opens values: version 1 without a key, version 2 (MAC'd) with one.
#[derive(Debug, Clone, Default)]
pub struct Codec {
    key: Option<MacKey>,
}

impl Codec {
    /// A codec writing MAC'd values with `key`, or checksummed ones without.
    pub fn new(key: Option<MacKey>) -> Codec {
        Codec { key }
    }

    /// Header bytes of the values this codec writes.
    pub fn header_bytes(&self) -> usize {
        if self.key.is_some() {
            HEADER_V2_BYTES
        } else {
            HEADER_V1_BYTES
        }
    }

    /// A value buffer for a payload of `payload_bytes`, header zeroed: fill
    /// `buf[self.header_bytes()..]`, then call [`Codec::seal`].
    pub fn buffer(&self, payload_bytes: usize) -> Vec<u8> {
        vec![0u8; self.header_bytes() + payload_bytes]
    }

    fn mac(key: &MacKey, common: &[u8], name: &str, payload: &[u8]) -> [u8; 32] {
        let mut h = blake3::Hasher::new_keyed(&key.0);
        h.update(common);
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name.as_bytes());
        h.update(payload);
        *h.finalize().as_bytes()
    }

    /// Writes the header of a value whose payload is already after the header, for the L2 key
    /// `name` and layout `digest`.
    pub fn seal(&self, buf: &mut [u8], digest: u64, name: &str) {
        let (head, payload) = buf.split_at_mut(self.header_bytes());
        self.seal_apart(head, payload, digest, name);
    }

    /// Writes into `head` (at least [`Codec::header_bytes`] long) the header of `payload`
    /// kept elsewhere: the disk tier puts a header in its own block, so that the payload lies
    /// block-aligned and can be read straight into an L1 page.
    pub fn seal_apart(&self, head: &mut [u8], payload: &[u8], digest: u64, name: &str) {
        if self.key.is_none() {
            return seal_v1(head, payload.len() as u64, xxh3_64(payload), digest, name);
        }
        let head = &mut head[..self.header_bytes()];
        let version: u16 = if self.key.is_some() { 2 } else { 1 };
        head[0..4].copy_from_slice(&MAGIC);
        head[4..6].copy_from_slice(&version.to_le_bytes());
        head[6..8].copy_from_slice(&0u16.to_le_bytes());
        head[8..16].copy_from_slice(&digest.to_le_bytes());
        head[16..24].copy_from_slice(&key_tag(name).to_le_bytes());
        head[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        match &self.key {
            None => head[32..40].copy_from_slice(&xxh3_64(payload).to_le_bytes()),
            Some(key) => {
                let (common, mac) = head.split_at_mut(COMMON_BYTES);
                mac.copy_from_slice(&Self::mac(key, common, name, payload));
            }
        }
    }

    /// The payload of `value` if it is a whole, intact page of `page_bytes` for layout `digest`
    /// stored under the L2 key `name` (and, with a key, written by a kvd holding it).
    pub fn open<'a>(
        &self,
        value: &'a [u8],
        digest: u64,
        name: &str,
        page_bytes: u64,
    ) -> Result<&'a [u8], Rejected> {
        if value.len() < COMMON_BYTES {
            return Err(if value.starts_with(&MAGIC[..value.len().min(4)]) {
                Rejected::Truncated
            } else {
                Rejected::Version
            });
        }
        // The reserved field must be zero until a later format gives it a meaning.
        if value[0..4] != MAGIC || value[6..8] != [0, 0] {
            return Err(Rejected::Version);
        }
        let header = match (u16::from_le_bytes([value[4], value[5]]), &self.key) {
            (1, None) => HEADER_V1_BYTES,
            (2, Some(_)) => HEADER_V2_BYTES,
            (1, Some(_)) => return Err(Rejected::Unauthenticated),
            (2, None) => return Err(Rejected::NeedsSecret),
            _ => return Err(Rejected::Version),
        };
        if value.len() < header {
            return Err(Rejected::Truncated);
        }
        let (head, payload) = value.split_at(header);
        check_common(head, digest, name, page_bytes, payload.len() as u64)?;
        match &self.key {
            None if xxh3_64(payload) != u64_at(head, 32) => Err(Rejected::Corrupt),
            // Compared in constant time: `blake3::Hash`'s equality is.
            Some(key)
                if blake3::Hash::from(Self::mac(key, &head[..COMMON_BYTES], name, payload))
                    != blake3::Hash::from_bytes(head[COMMON_BYTES..].try_into().expect("32")) =>
            {
                Err(Rejected::Forged)
            }
            _ => Ok(payload),
        }
    }

    /// Checks a version-1 header kept apart from its payload (see [`Codec::seal_apart`]) for
    /// a page of `page_bytes`, layout `digest`, key `name`, and gives the payload's checksum it
    /// declares: the caller compares it with `xxh3_64` of the bytes it read. This codec must
    /// have no key (the disk is this node's own: checksummed, not MAC'd).
    pub fn open_apart(
        &self,
        head: &[u8],
        digest: u64,
        name: &str,
        page_bytes: u64,
    ) -> Result<u64, Rejected> {
        if head.len() < HEADER_V1_BYTES {
            return Err(Rejected::Truncated);
        }
        if head[0..4] != MAGIC || head[6..8] != [0, 0] {
            return Err(Rejected::Version);
        }
        match (u16::from_le_bytes([head[4], head[5]]), &self.key) {
            (1, None) => {}
            (1, Some(_)) => return Err(Rejected::Unauthenticated),
            (2, None) => return Err(Rejected::NeedsSecret),
            _ => return Err(Rejected::Version),
        }
        check_common(head, digest, name, page_bytes, page_bytes)?;
        Ok(u64_at(head, 32))
    }
}

/// Writes a version-1 header into `head` for a payload of `payload_bytes` whose xxh3-64 is
/// `payload_xxh3`, hashed by whoever holds it (the disk tier hashes an L1 page in place).
pub fn seal_v1(head: &mut [u8], payload_bytes: u64, payload_xxh3: u64, digest: u64, name: &str) {
    head[0..4].copy_from_slice(&MAGIC);
    head[4..6].copy_from_slice(&1u16.to_le_bytes());
    head[6..8].copy_from_slice(&0u16.to_le_bytes());
    head[8..16].copy_from_slice(&digest.to_le_bytes());
    head[16..24].copy_from_slice(&key_tag(name).to_le_bytes());
    head[24..32].copy_from_slice(&payload_bytes.to_le_bytes());
    head[32..40].copy_from_slice(&payload_xxh3.to_le_bytes());
}

/// The common header's layout digest, key tag and length, for a payload of `payload_bytes`.
fn check_common(
    head: &[u8],
    digest: u64,
    name: &str,
    page_bytes: u64,
    payload_bytes: u64,
) -> Result<(), Rejected> {
    if u64_at(head, 8) != digest || u64_at(head, 16) != key_tag(name) {
        return Err(Rejected::Foreign);
    }
    let declared = u64_at(head, 24);
    if payload_bytes < declared {
        return Err(Rejected::Truncated);
    }
    if declared != page_bytes || payload_bytes != declared {
        return Err(Rejected::Length);
    }
    Ok(())
}

#[cfg(test)]
#[path = "value_tests.rs"]
mod tests;
