//! What every part's flags are checked with: one error type and one range check, so that each
//! error is one line naming the flag, its value and the fix. A leaf: it imports nothing of the
//! server, and each part's flags live beside the part and use it — the tiers' in
//! `tiers::{disk, l2}::config`, the removal feed's in `l1::events`, the rest in `life::flags`,
//! all resolved together in `life::config`.

/// A bad setting: one line naming the flag and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

/// Checks that flag `flag`'s `value` lies in `range`; otherwise the one-line error is
/// `{flag} {value}: {fix}`, `fix` saying what to pass instead. Every flag with a range goes
/// through here, so that each error names the flag and the value the same way.
pub fn check_flag<T: PartialOrd + std::fmt::Display>(
    flag: &str,
    value: T,
    range: impl std::ops::RangeBounds<T>,
    fix: &str,
) -> Result<(), ConfigError> {
    if range.contains(&value) {
        Ok(())
    } else {
        Err(ConfigError(format!("{flag} {value}: {fix}")))
    }
}
