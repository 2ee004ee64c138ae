//! The one place that maps Rust errors to Python exceptions:
//! `KvdError` (base) > `ConnectionLost` (kvd unreachable, timed out, or gone — treat as a miss;
//! `TimedOut` when kvd was silent, and may still act on the request up to its deadline),
//! `ServerError` (kvd refused; `args[0]` names the code) > `Busy` (a queue is full) and
//! `NotReady` (kvd is still making its pool) — both worth retrying — and `Expired` (a copy's
//! deadline passed before kvd started it: nothing copied); `VmmMemoryError` (memory
//! legacy IPC cannot share), `DeviceError` (the CUDA driver failed here). Layers that cannot be
//! registered as given are a `ValueError`.

use kvd_gpu::GpuError;
use kvd_proto::client::ClientError;
use kvd_proto::wire::ErrorCode;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

use crate::plan::PlanError;

create_exception!(_native, KvdError, PyException, "Base of every kvd error.");
create_exception!(
    _native,
    ConnectionLost,
    KvdError,
    "kvd could not be reached, did not answer in time, or the connection broke."
);
create_exception!(
    _native,
    TimedOut,
    ConnectionLost,
    "kvd did not answer in time. It may be stopped or overloaded and may still act on the request later, up to the request's deadline."
);
create_exception!(
    _native,
    ServerError,
    KvdError,
    "kvd answered with an error; `args[0]` is the code name, `args[1]` the message."
);
create_exception!(
    _native,
    Busy,
    ServerError,
    "A kvd queue is full (a device's copy queue): retry shortly."
);
create_exception!(
    _native,
    NotReady,
    ServerError,
    "kvd is still populating or pinning its pool: retry once /healthz answers 200."
);
create_exception!(
    _native,
    Expired,
    ServerError,
    "The request's deadline passed before kvd could start its copy: nothing was copied."
);
create_exception!(
    _native,
    VmmMemoryError,
    KvdError,
    "The KV cache is CUDA VMM memory that legacy IPC cannot share."
);
create_exception!(
    _native,
    DeviceError,
    KvdError,
    "A CUDA driver call failed in this process."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvdError", py.get_type::<KvdError>())?;
    m.add("ConnectionLost", py.get_type::<ConnectionLost>())?;
    m.add("TimedOut", py.get_type::<TimedOut>())?;
    m.add("ServerError", py.get_type::<ServerError>())?;
    m.add("Busy", py.get_type::<Busy>())?;
    m.add("NotReady", py.get_type::<NotReady>())?;
    m.add("Expired", py.get_type::<Expired>())?;
    m.add("VmmMemoryError", py.get_type::<VmmMemoryError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    Ok(())
}

/// A client error as a Python exception.
pub(crate) fn client_error(e: ClientError) -> PyErr {
    match e {
        ClientError::Server { code, message } => {
            let args = (format!("{code:?}"), message);
            match code {
                ErrorCode::VmmMemory => VmmMemoryError::new_err(args.1),
                ErrorCode::Busy => Busy::new_err(args),
                ErrorCode::NotReady => NotReady::new_err(args),
                ErrorCode::Expired => Expired::new_err(args),
                _ => ServerError::new_err(args),
            }
        }
        ClientError::Timeout { .. } => TimedOut::new_err(e.to_string()),
        ClientError::Connect { .. } | ClientError::Disconnected(_) => {
            ConnectionLost::new_err(e.to_string())
        }
        ClientError::FdPass(_) | ClientError::Protocol(_) => KvdError::new_err(e.to_string()),
    }
}

/// A device-layer error as a Python exception.
pub(crate) fn gpu_error(e: GpuError) -> PyErr {
    match e {
        GpuError::VmmMemory => VmmMemoryError::new_err(e.to_string()),
        _ => DeviceError::new_err(e.to_string()),
    }
}

/// A registration the layers' addresses rule out, as a `ValueError`.
pub(crate) fn plan_error(e: PlanError) -> PyErr {
    PyValueError::new_err(e.to_string())
}
