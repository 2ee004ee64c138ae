//! The L1 pool's layout: its size and the size of the pieces it is pinned in, in one value.
//!
//! The pool is registered with a GPU driver piece by piece, and the driver refuses a copy that
//! spans two registrations (`CUDA_ERROR_INVALID_VALUE`, seen on an H200). So three parts must
//! agree on where pieces begin: the pinning (one registration per piece), the page allocator
//! (a slab is one piece, so no page spans two) and the coalescer (no merged run crosses a
//! piece). They all take their boundaries from a [`PoolLayout`], which makes the rule "a copy
//! never crosses a pinned piece" a property of this one type. The pool holds whole pieces only:
//! a size that is not a multiple of the piece size is rounded down.

use std::ops::Range;

use crate::error::GpuError;

/// Pool size and pinned-piece size; the pool is `pieces() * piece_bytes()` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PoolLayout {
    piece_bytes: u64,
    pieces: u32,
}

impl PoolLayout {
    /// As many whole pieces of `piece_bytes` as fit in `size_bytes` (at most `u32::MAX`).
    pub fn new(size_bytes: u64, piece_bytes: u64) -> Result<Self, GpuError> {
        if piece_bytes == 0 {
            return Err(GpuError::Invalid(
                "the pool's piece (slab) size must be above zero".into(),
            ));
        }
        let pieces = u32::try_from(size_bytes / piece_bytes).unwrap_or(u32::MAX);
        if pieces == 0 {
            return Err(GpuError::Invalid(format!(
                "a pool of {size_bytes} bytes holds no whole {piece_bytes}-byte piece; \
                 make the pool larger or the slabs smaller"
            )));
        }
        Ok(PoolLayout {
            piece_bytes,
            pieces,
        })
    }

    /// Bytes in the pool: whole pieces only.
    pub fn size_bytes(&self) -> u64 {
        self.pieces as u64 * self.piece_bytes
    }

    /// Bytes in one piece (one slab, one pinned registration).
    pub fn piece_bytes(&self) -> u64 {
        self.piece_bytes
    }

    /// Number of pieces.
    pub fn pieces(&self) -> u32 {
        self.pieces
    }

    /// The piece holding pool byte `offset_bytes`.
    pub fn piece_of(&self, offset_bytes: u64) -> u64 {
        offset_bytes / self.piece_bytes
    }

    /// Byte range of piece `piece` in the pool.
    pub fn piece_range(&self, piece: u32) -> Range<u64> {
        let start = piece as u64 * self.piece_bytes;
        start..start + self.piece_bytes
    }

    /// Byte range covered by pieces `pieces`.
    pub fn pieces_range(&self, pieces: Range<u32>) -> Range<u64> {
        pieces.start as u64 * self.piece_bytes..pieces.end as u64 * self.piece_bytes
    }

    /// Whether `len_bytes` (above zero) at `offset_bytes` lie in one piece, so that one copy
    /// descriptor may cover them.
    pub fn within_one_piece(&self, offset_bytes: u64, len_bytes: u64) -> bool {
        len_bytes > 0 && self.piece_of(offset_bytes) == self.piece_of(offset_bytes + len_bytes - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_pieces_only_and_ranges_tile_the_pool() {
        let l = PoolLayout::new(10 * 1024 + 100, 1024).unwrap();
        assert_eq!(l.pieces(), 10);
        assert_eq!(l.size_bytes(), 10 * 1024);
        assert_eq!(l.piece_range(3), 3072..4096);
        assert_eq!(l.pieces_range(2..5), 2048..5120);
        assert_eq!(l.piece_of(4095), 3);
        assert_eq!(l.piece_of(4096), 4);
        assert!(l.within_one_piece(3072, 1024));
        assert!(!l.within_one_piece(3072, 1025));
        assert!(!l.within_one_piece(4095, 2));
        assert!(!l.within_one_piece(0, 0));
    }

    #[test]
    fn empty_layouts_are_refused_with_the_fix() {
        assert!(PoolLayout::new(1 << 20, 0).is_err());
        let e = PoolLayout::new(100, 1024).unwrap_err().to_string();
        assert!(e.contains("make the pool larger"), "{e}");
    }
}
