//! The GPU data-plane benchmark (CUDA issue).

use anyhow::{bail, Result};

/// Runs the data-plane benchmark.
pub fn run(_kvd: &std::path::Path, _quick: bool) -> Result<()> {
    bail!("the data-plane benchmark needs the CUDA backend")
}
