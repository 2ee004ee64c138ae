//! Why a request failed, and the one place that turns it into a wire reply. Handlers return
//! `Result<Reply, RequestError>`; expected outcomes (a miss, a refused store) are replies, not
//! errors. Every message says what to do about it.

use kvd_gpu::GpuError;

use crate::data::copier::SubmitError;
use crate::wire::{ErrorCode, Reply};

/// A request kvd could not carry out.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The frame could not be decoded.
    #[error("{0}")]
    Malformed(String),
    /// The client speaks another protocol version.
    #[error("{0}")]
    Version(String),
    /// The session has not said hello.
    #[error("send hello (with the protocol version) before any other request")]
    HelloRequired,
    /// The region is not this session's.
    #[error("region {0} is not registered by this session (unregistered, or the session was reset); register again")]
    UnknownRegion(u32),
    /// An argument is out of range or inconsistent.
    #[error("{0}")]
    Invalid(String),
    /// The pool is not ready yet.
    #[error("{0}; retry once /healthz answers 200")]
    NotReady(String),
    /// kvd is shutting down.
    #[error("{0}")]
    ShuttingDown(String),
    /// A device-layer call failed.
    #[error(transparent)]
    Gpu(#[from] GpuError),
    /// A copy failed on the device.
    #[error("{0}")]
    CopyFailed(&'static str),
    /// VMM memory sent where it cannot be imported.
    #[error("{0}")]
    VmmMemory(String),
    /// A device's copy queue is full.
    #[error("{0}")]
    Busy(String),
    /// Descriptors named by a registration never arrived.
    #[error("{0}")]
    FdMissing(String),
    /// A bug in kvd.
    #[error("{0}")]
    Internal(String),
    /// The request's deadline passed before its copy could start; nothing was copied.
    #[error("{0}")]
    Expired(String),
}

impl RequestError {
    /// The wire code.
    pub fn code(&self) -> ErrorCode {
        match self {
            RequestError::Malformed(_) => ErrorCode::Malformed,
            RequestError::Version(_) => ErrorCode::VersionMismatch,
            RequestError::HelloRequired => ErrorCode::HelloRequired,
            RequestError::UnknownRegion(_) => ErrorCode::UnknownRegion,
            RequestError::Invalid(_) => ErrorCode::InvalidArgument,
            RequestError::NotReady(_) => ErrorCode::NotReady,
            RequestError::ShuttingDown(_) => ErrorCode::ShuttingDown,
            RequestError::Gpu(GpuError::VmmMemory) | RequestError::VmmMemory(_) => {
                ErrorCode::VmmMemory
            }
            RequestError::Gpu(GpuError::Invalid(_) | GpuError::OutOfBounds { .. }) => {
                ErrorCode::InvalidArgument
            }
            RequestError::Gpu(_) | RequestError::CopyFailed(_) => ErrorCode::Device,
            RequestError::Busy(_) => ErrorCode::Busy,
            RequestError::FdMissing(_) => ErrorCode::FdMissing,
            RequestError::Internal(_) => ErrorCode::Internal,
            RequestError::Expired(_) => ErrorCode::Expired,
        }
    }
}

impl From<SubmitError> for RequestError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::Busy { .. } => RequestError::Busy(e.to_string()),
            SubmitError::Stopped(_) => RequestError::ShuttingDown(e.to_string()),
            SubmitError::Device(g) => RequestError::Gpu(g),
            SubmitError::Expired { .. } => RequestError::Expired(e.to_string()),
        }
    }
}

impl From<RequestError> for Reply {
    fn from(e: RequestError) -> Reply {
        Reply::error(e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_errors_keep_their_meaning_on_the_wire() {
        let vmm: Reply = RequestError::Gpu(GpuError::VmmMemory).into();
        let Reply::Error(e) = vmm else { panic!() };
        assert_eq!(e.code, ErrorCode::VmmMemory);
        assert!(e.message.contains("expandable_segments"), "{}", e.message);
        assert_eq!(
            RequestError::Gpu(GpuError::Invalid("x".into())).code(),
            ErrorCode::InvalidArgument
        );
        assert_eq!(
            RequestError::Gpu(GpuError::Unavailable("x".into())).code(),
            ErrorCode::Device
        );
        let busy = RequestError::from(SubmitError::Busy {
            device: "cuda:0".into(),
            lane: "store",
            depth: 4,
        });
        assert_eq!(busy.code(), ErrorCode::Busy);
        assert!(busy.to_string().contains("--copy-queue"));
        assert!(busy.to_string().contains("the store copy queue of cuda:0"));
    }
}
