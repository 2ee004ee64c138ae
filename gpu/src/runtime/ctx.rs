//! A device as everything imported on it sees it: its label for logs, its ordinal, and what
//! keeps it usable (the [`Runtime::Context`]). Imports, event rings, engines and completions
//! each hold an `Arc` of it, so the device outlives every object made on it, and the engine
//! tells its own device's objects from another's by pointer.

use crate::error::{release_failed, GpuError};
use crate::runtime::api::Runtime;

/// One opened device, shared by what was made on it.
#[derive(Debug)]
pub struct DeviceCtx<R: Runtime> {
    /// `cuda:0 (GPU-…)`, for logs.
    pub(crate) label: String,
    /// Ordinal in kvd's own view.
    pub(crate) ordinal: i32,
    /// What keeps the device usable by this process.
    pub(crate) ctx: R::Context,
}

impl<R: Runtime> DeviceCtx<R> {
    /// Makes this device current on the calling thread.
    pub(crate) fn make_current(&self) -> Result<(), GpuError> {
        R::make_current(&self.ctx)
    }
}

/// Destroys an event this process created or opened, once; failures are logged and counted.
pub(crate) fn destroy_event<R: Runtime>(e: R::Event, what: &str) {
    // SAFETY: callers own `e`, made its device current, and never use it again.
    if let Err(err) = unsafe { R::event_destroy(e) } {
        release_failed(what, err);
    }
}

/// Releases a VMM allocation handle, once; failures are logged and counted.
pub(crate) fn release_handle<R: Runtime>(h: R::AllocHandle) {
    // SAFETY: callers got `h` from the runtime (create, retain or import) and release it once.
    if let Err(e) = unsafe { R::mem_release(h) } {
        release_failed("a VMM allocation handle", e);
    }
}
