//! The tiers below L1, side by side: the local disk ([`disk`]) and the L2 shared by every
//! node's kvd ([`l2`]). Each is optional, each holds whole chunks under the keys L1 uses, and
//! both seal their values with one header ([`value`]) that is checked before a byte reaches
//! an L1 page.
//!
//! Each is a [`fill::Tier`]: asked by a lookup for the part of its prefix L1 lacks, it answers
//! for what it holds, through one fill both share ([`fill`]). [`chain`] asks them in turn,
//! L1 → disk → L2.

pub mod chain;
pub mod disk;
pub mod fill;
pub mod l2;
pub mod value;
