//! The bytes of one chunk in L2: a fixed 40-byte header, then the chunk's page exactly as it
//! lies in an L1 page. An L2 is shared by every node and outlives any one kvd, so a value may be
//! truncated (a full server, a cut connection), written by another kvd version, written for
//! another KV layout under a colliding key, or damaged; the header lets kvd reject each of these
//! before a byte of it reaches an L1 page, and so a GPU.
//!
//! Header, little-endian: magic `kvdL` (4) · format version u16 · reserved u16 · layout digest
//! u64 · key tag u64 (xxh3 of the L2 key: a value copied under another key is foreign) · payload
//! length u64 · xxh3-64 of the payload u64. xxh3 hashes at over 10 GB/s per core, so checking a
//! 32 MiB chunk costs about 3 ms of a blocking thread, never a tokio worker.

use xxhash_rust::xxh3::xxh3_64;

/// Bytes before the payload.
pub const HEADER_BYTES: usize = 40;
/// Current format version.
pub const FORMAT_VERSION: u16 = 1;
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
}

impl Rejected {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Rejected::Truncated => "truncated",
            Rejected::Version => "version",
            Rejected::Foreign => "foreign",
            Rejected::Length => "length",
            Rejected::Corrupt => "corrupt",
        }
    }
}

/// The tag of an L2 key stored in its values' headers.
pub fn key_tag(key: &str) -> u64 {
    xxh3_64(key.as_bytes())
}

/// A value buffer for a payload of `payload_bytes`, header zeroed: fill
/// `buf[HEADER_BYTES..]`, then call [`seal`].
pub fn buffer(payload_bytes: usize) -> Vec<u8> {
    vec![0u8; HEADER_BYTES + payload_bytes]
}

/// Writes the header of a value whose payload is already in `buf[HEADER_BYTES..]`.
pub fn seal(buf: &mut [u8], digest: u64, key_tag: u64) {
    let (head, payload) = buf.split_at_mut(HEADER_BYTES);
    head[0..4].copy_from_slice(&MAGIC);
    head[4..6].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    head[6..8].copy_from_slice(&0u16.to_le_bytes());
    head[8..16].copy_from_slice(&digest.to_le_bytes());
    head[16..24].copy_from_slice(&key_tag.to_le_bytes());
    head[24..32].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    head[32..40].copy_from_slice(&xxh3_64(payload).to_le_bytes());
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut v = [0u8; 8];
    v.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(v)
}

/// The payload of `value` if it is a whole, intact page of `page_bytes` for layout `digest`
/// stored under the key with tag `key_tag`.
pub fn open(value: &[u8], digest: u64, key_tag: u64, page_bytes: u64) -> Result<&[u8], Rejected> {
    if value.len() < HEADER_BYTES {
        return Err(if value.starts_with(&MAGIC[..value.len().min(4)]) {
            Rejected::Truncated
        } else {
            Rejected::Version
        });
    }
    let (head, payload) = value.split_at(HEADER_BYTES);
    // The reserved field must be zero until a later format gives it a meaning.
    if head[0..4] != MAGIC
        || u16::from_le_bytes([head[4], head[5]]) != FORMAT_VERSION
        || head[6..8] != [0, 0]
    {
        return Err(Rejected::Version);
    }
    if u64_at(head, 8) != digest || u64_at(head, 16) != key_tag {
        return Err(Rejected::Foreign);
    }
    let declared = u64_at(head, 24);
    if (payload.len() as u64) < declared {
        return Err(Rejected::Truncated);
    }
    if declared != page_bytes || payload.len() as u64 != declared {
        return Err(Rejected::Length);
    }
    if xxh3_64(payload) != u64_at(head, 32) {
        return Err(Rejected::Corrupt);
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sealed(payload: &[u8], digest: u64, tag: u64) -> Vec<u8> {
        let mut b = buffer(payload.len());
        b[HEADER_BYTES..].copy_from_slice(payload);
        seal(&mut b, digest, tag);
        b
    }

    #[test]
    fn an_intact_value_opens_to_its_payload() {
        let payload: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        let v = sealed(&payload, 11, key_tag("k"));
        assert_eq!(open(&v, 11, key_tag("k"), 4096).unwrap(), &payload[..]);
    }

    #[test]
    fn each_defect_is_rejected_with_its_reason() {
        let payload = vec![5u8; 1000];
        let tag = key_tag("a");
        let v = sealed(&payload, 3, tag);
        assert_eq!(open(&v[..999], 3, tag, 1000), Err(Rejected::Truncated));
        assert_eq!(open(&v[..20], 3, tag, 1000), Err(Rejected::Truncated));
        assert_eq!(open(b"hello world", 3, tag, 1000), Err(Rejected::Version));
        assert_eq!(open(&v, 4, tag, 1000), Err(Rejected::Foreign));
        assert_eq!(open(&v, 3, key_tag("b"), 1000), Err(Rejected::Foreign));
        assert_eq!(open(&v, 3, tag, 2000), Err(Rejected::Length));
        let mut longer = v.clone();
        longer.push(0);
        assert_eq!(open(&longer, 3, tag, 1000), Err(Rejected::Length));
        let mut flipped = v.clone();
        flipped[HEADER_BYTES + 500] ^= 1;
        assert_eq!(open(&flipped, 3, tag, 1000), Err(Rejected::Corrupt));
        let mut newer = v;
        newer[4] = 2;
        assert_eq!(open(&newer, 3, tag, 1000), Err(Rejected::Version));
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_open_or_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(open(&bytes, 1, 2, 64).is_err());
        }

        #[test]
        fn any_single_bit_flip_is_rejected(len in 1usize..300, bit in any::<usize>()) {
            let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let mut v = sealed(&payload, 9, 10);
            let bit = bit % (v.len() * 8);
            v[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(open(&v, 9, 10, len as u64).is_err());
        }
    }
}
