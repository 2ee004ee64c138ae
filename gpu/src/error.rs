//! The one error type of the device layer. The server maps it to wire error codes in one place
//! (`kvd_server::control::error`), so every variant says what went wrong and, where there is
//! one, the fix.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};

/// Errors from pool memory, imports and copies.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// An OS call failed (mmap, memfd, madvise, ...).
    #[error("{context}: {source}")]
    Io {
        /// What kvd was doing.
        context: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// A copy or access would leave the memory it names.
    #[error("{what}: range {offset_bytes}+{len_bytes} exceeds {size_bytes} bytes")]
    OutOfBounds {
        /// Which memory (pool, import).
        what: &'static str,
        /// Start of the range.
        offset_bytes: u64,
        /// Length of the range.
        len_bytes: u64,
        /// Size of the memory.
        size_bytes: u64,
    },
    /// A CUDA driver or HIP runtime call failed (the call's name says which).
    #[error("{call} failed: {}{hint}", named(.name, .message))]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The error's name, e.g. `CUDA_ERROR_INVALID_VALUE` or `hipErrorInvalidValue`.
        name: String,
        /// The driver's description.
        message: String,
        /// A sentence naming the fix, with a leading separator, or empty.
        hint: String,
    },
    /// The memory cannot be imported by legacy IPC (CUDA or HIP) because it is VMM memory.
    #[error(
        "KV cache memory is a GPU VMM allocation (cuMemCreate/hipMemCreate): it cannot be shared \
         by legacy CUDA or HIP IPC. This happens with PYTORCH_CUDA_ALLOC_CONF/PYTORCH_ALLOC_CONF=\
         expandable_segments:True (PYTORCH_HIP_ALLOC_CONF on ROCm) and with vLLM's cumem \
         allocator (sleep mode). Fix: register it by file descriptor (kvd imports VMM memory over \
         its fd socket), or unset expandable_segments"
    )]
    VmmMemory,
    /// The requested backend or device is not present on this machine.
    #[error("{0}")]
    Unavailable(String),
    /// A request that the device layer cannot satisfy as given.
    #[error("{0}")]
    Invalid(String),
}

impl GpuError {
    /// A driver error with `hint` (a sentence with its leading separator) in place of the one
    /// the call's status gave; other errors are returned as they are.
    pub fn with_hint(self, hint: &str) -> Self {
        match self {
            GpuError::Driver {
                call,
                name,
                message,
                ..
            } => GpuError::Driver {
                call,
                name,
                message,
                hint: hint.to_string(),
            },
            other => other,
        }
    }

    /// Wraps an OS error with what kvd was doing.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        GpuError::Io {
            context: context.into(),
            source,
        }
    }
}

/// An error's name and description, the description left out where it only repeats the name
/// (ROCm 5's `hipGetErrorString` returns the name for some codes).
fn named(name: &str, message: &str) -> String {
    if message.is_empty() || message == name {
        name.to_string()
    } else {
        format!("{name} ({message})")
    }
}

static RELEASE_ERRORS: AtomicU64 = AtomicU64::new(0);

/// Device resources whose release failed since start, in any backend (for
/// `kvd_gpu_release_errors_total`).
pub fn release_errors() -> u64 {
    RELEASE_ERRORS.load(Ordering::Relaxed)
}

/// Logs and counts a failed release; `Drop` impls use it instead of panicking.
#[cfg_attr(not(any(feature = "cuda", feature = "hip")), allow(dead_code))]
pub(crate) fn release_failed(what: &str, e: GpuError) {
    RELEASE_ERRORS.fetch_add(1, Ordering::Relaxed);
    tracing::error!("releasing {what} failed: {e}");
}

/// Checks that `offset + len` lies within `size`, without overflow.
pub fn check_range(what: &'static str, offset: u64, len: u64, size: u64) -> Result<(), GpuError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(GpuError::OutOfBounds {
            what,
            offset_bytes: offset,
            len_bytes: len,
            size_bytes: size,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_driver_error_names_itself_once() {
        let e = |message: &str| GpuError::Driver {
            call: "hipInit",
            name: "hipErrorInvalidDevice".into(),
            message: message.into(),
            hint: String::new(),
        };
        assert_eq!(
            e("hipErrorInvalidDevice").to_string(),
            "hipInit failed: hipErrorInvalidDevice"
        );
        assert_eq!(
            e("invalid device ordinal").to_string(),
            "hipInit failed: hipErrorInvalidDevice (invalid device ordinal)"
        );
    }

    #[test]
    fn range_checks_catch_overflow_and_overrun() {
        assert!(check_range("pool", 0, 10, 10).is_ok());
        assert!(check_range("pool", 5, 5, 10).is_ok());
        assert!(check_range("pool", 5, 6, 10).is_err());
        assert!(check_range("pool", u64::MAX, 2, 10).is_err());
    }
}
