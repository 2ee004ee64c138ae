//! The L2 tier's secrets: the password (from `--l2-password-file`, `KVD_L2_PASSWORD` or the
//! URL) and the values' MAC key (from `--l2-secret-file`). Neither passes through anything kvd
//! prints.

use std::path::Path;

use crate::config::ConfigError;
use crate::tiers::value::MacKey;

/// The environment variable that may hold the L2 password.
pub const PASSWORD_ENV: &str = "KVD_L2_PASSWORD";
/// Fewest bytes a `--l2-secret-file` must hold.
pub const MIN_SECRET_BYTES: usize = 16;

/// A password: cloned and compared like a string, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `s`.
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    /// The secret itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

pub(super) fn read_file(flag: &str, path: &Path) -> Result<Vec<u8>, ConfigError> {
    std::fs::read(path).map_err(|e| {
        ConfigError(format!(
            "{flag} {}: cannot read it ({e}); give a file kvd's user can read",
            path.display()
        ))
    })
}

/// The bytes of a secret file without the newline an editor or `echo` leaves.
pub(super) fn trim_newlines(mut b: Vec<u8>) -> Vec<u8> {
    while matches!(b.last(), Some(b'\n' | b'\r')) {
        b.pop();
    }
    b
}

/// The MAC key in `path`: any secret of at least [`MIN_SECRET_BYTES`], stretched to 32 bytes
/// by BLAKE3's key derivation (so a hex or base64 text file works as well as raw bytes).
pub fn read_mac_key(path: &Path) -> Result<MacKey, ConfigError> {
    let flag = "--l2-secret-file";
    let secret = trim_newlines(read_file(flag, path)?);
    if secret.len() < MIN_SECRET_BYTES {
        return Err(ConfigError(format!(
            "{flag} {}: holds {} bytes, fewer than {MIN_SECRET_BYTES}; write a long random \
             secret into it, e.g. openssl rand -hex 32 > {}",
            path.display(),
            secret.len(),
            path.display()
        )));
    }
    Ok(MacKey(blake3::derive_key(
        "kvd 2026-12 L2 value MAC key v1",
        &secret,
    )))
}
