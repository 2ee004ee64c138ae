//! Fuzz targets for every parser that reads bytes a peer controls: kvd's request and reply
//! frames, the ZMTP greeting, commands and frames, the fd socket's header, and registration
//! layouts (the geometry a client's `Register` makes kvd copy by).
//!
//! Each target is a plain function of a byte slice that panics when an invariant breaks — not
//! only on a crash: a frame that decodes must encode back to the same bytes, the ZMTP reader
//! must keep to its limits, every copy run a layout yields must lie inside the client's
//! allocation and the page. `scripts/fuzz.sh` runs them under AFL++ (`cargo afl`, the pinned
//! stable toolchain) through the `kvd-fuzz` binary; `cargo test -p kvd-fuzz` replays the
//! committed corpora and every input that once failed (`regressions/`), so CI needs no engine.
#![forbid(unsafe_code)]

pub mod fdpass;
pub mod geometry;
pub mod seeds;
pub mod wire;
pub mod zmtp;

/// A fuzz target: panics when the input breaks an invariant.
pub type Target = fn(&[u8]);

/// Every target by name (the name is the corpus directory's).
pub const TARGETS: &[(&str, Target)] = &[
    ("wire_request", wire::request),
    ("wire_reply", wire::reply),
    ("zmtp", zmtp::stream),
    ("fd_header", fdpass::header),
    ("geometry", geometry::layout),
];

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|&(_, t)| t)
}

/// Reads numbers from fuzz input; past its end every read is 0, so any input is a whole case.
#[derive(Debug)]
pub struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    /// A cursor at the start of `data`.
    pub fn new(data: &'a [u8]) -> Self {
        Cursor(data)
    }

    fn take<const N: usize>(&mut self) -> [u8; N] {
        let mut out = [0u8; N];
        let n = N.min(self.0.len());
        out[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        out
    }

    /// The next byte.
    pub fn u8(&mut self) -> u8 {
        self.take::<1>()[0]
    }

    /// The next u16 (LE).
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.take())
    }

    /// The next u32 (LE).
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }

    /// The next u64 (LE).
    pub fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
}
