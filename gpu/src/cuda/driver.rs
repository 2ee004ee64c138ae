//! The `result` layer over cudarc's raw `sys` bindings: loading the driver without panicking,
//! turning `CUresult` into [`GpuError`] with the call's name and the operator's fix, the driver
//! handles kvd keeps as newtypes that may cross threads, and the primary context of a device as
//! an owned, reference-counted value. `cuda/runtime.rs` builds the [`crate::runtime::Runtime`]
//! methods on these.
//!
//! cudarc loads `libcuda` on first use and panics when it is absent or lacks a symbol, so every
//! entry point here checks [`available`] first and optional symbols with `has_symbol`.

use std::ffi::CStr;
use std::sync::OnceLock;

use cudarc::driver::sys::{self, CUresult};

use crate::error::{release_failed, GpuError};

/// Whether the CUDA driver could be loaded and initialised; decided once.
pub fn available() -> Result<(), GpuError> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: is_culib_present only tries to dlopen the library names and drops them.
            if !unsafe { sys::is_culib_present() } {
                return Err(
                    "libcuda.so could not be loaded (no NVIDIA driver on this machine)".into(),
                );
            }
            // SAFETY: the library is present; cuInit(0) is the documented first call.
            let r = unsafe { sys::cuInit(0) };
            check("cuInit", r).map_err(|e| e.to_string())
        })
        .clone()
        .map_err(GpuError::Unavailable)
}

/// Whether the loaded driver exports `name`. Call only after [`available`] succeeded.
pub(crate) fn has_symbol(name: &str) -> bool {
    // SAFETY: culib() is loaded (available() succeeded); get() only looks the symbol up.
    unsafe { sys::culib().get::<*const ()>(name.as_bytes()).is_ok() }
}

fn error_string(r: CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static string or leaves it null.
    let ok = unsafe { sys::cuGetErrorString(r, &mut p) } == CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: the driver returned a NUL-terminated static string.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        "no description".into()
    }
}

/// Hints that name the fix for the errors operators meet.
fn hint(call: &str, r: CUresult) -> &'static str {
    use CUresult::*;
    match (call, r) {
        ("cuIpcGetMemHandle", CUDA_ERROR_INVALID_VALUE) => {
            "; the memory is probably a VMM allocation (expandable_segments:True or vLLM's cumem \
             allocator), which legacy CUDA IPC cannot share: register it by file descriptor"
        }
        ("cuIpcOpenMemHandle_v2", CUDA_ERROR_INVALID_VALUE | CUDA_ERROR_INVALID_HANDLE) => {
            "; the exporting process may have exited or freed the memory, or kvd and the client \
             do not see the same GPU"
        }
        ("cuIpcOpenMemHandle_v2", CUDA_ERROR_ALREADY_MAPPED) => {
            "; this allocation is already mapped by this kvd"
        }
        (_, CUDA_ERROR_OUT_OF_MEMORY) => "; the GPU or host is out of memory",
        (_, CUDA_ERROR_NOT_PERMITTED | CUDA_ERROR_NOT_SUPPORTED) => {
            "; the driver or the container does not allow this (check the NVIDIA container runtime \
             and that kvd can see the GPUs)"
        }
        (_, CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED) => "; the pool is already pinned",
        _ => "",
    }
}

/// Turns a `CUresult` into a `Result`, naming the call.
pub(crate) fn check(call: &'static str, r: CUresult) -> Result<(), GpuError> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    Err(GpuError::Driver {
        call,
        name: format!("{r:?}"),
        message: error_string(r),
        hint: hint(call, r).to_string(),
    })
}

/// A `CUcontext`. Contexts are driver objects that any thread may make current; kvd retains the
/// primary context of a device for as long as it uses one ([`PrimaryContext`]).
#[derive(Debug, Clone, Copy)]
pub struct Context(pub(crate) sys::CUcontext);

// SAFETY: a CUcontext is an opaque driver handle, valid on any thread that makes it current
// (cuCtxSetCurrent); the driver synchronises its own state.
unsafe impl Send for Context {}
// SAFETY: as above; the handle itself is never mutated.
unsafe impl Sync for Context {}

/// A `CUstream` of kvd's own or of a client (as PyTorch passes it). Streams are driver objects
/// usable from any thread of the process once their context is current.
#[derive(Debug, Clone, Copy)]
pub struct Stream(pub(crate) sys::CUstream);

// SAFETY: an opaque driver handle; the driver serialises work submitted to one stream from
// several threads, and kvd submits to each of its streams from one thread only.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

/// A `CUevent`: kvd's completion events and both sides' interprocess events.
#[derive(Debug, Clone, Copy)]
pub struct Event(pub(crate) sys::CUevent);

// SAFETY: an opaque driver handle usable from any thread with its context current; recording
// and querying are thread-safe in the driver. Owners destroy each event once, in Drop.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

/// Creates an interprocess event (timing off) and exports its IPC handle. The caller owns the
/// event (it must be destroyed with `cuEventDestroy_v2`); the device's context must be current.
pub(crate) fn create_ipc_event() -> Result<(Event, [u8; 64]), GpuError> {
    let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
        | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
    let mut e: sys::CUevent = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the caller made the context current.
    check("cuEventCreate", unsafe {
        sys::cuEventCreate(&mut e, flags)
    })?;
    let mut h = sys::CUipcEventHandle { reserved: [0; 64] };
    // SAFETY: `e` is an interprocess event just created; out-pointer to a local.
    let r = unsafe { sys::cuIpcGetEventHandle(&mut h, e) };
    if let Err(err) = check("cuIpcGetEventHandle", r) {
        // SAFETY: `e` was created above and is not used after this.
        if let Err(d) = check("cuEventDestroy_v2", unsafe { sys::cuEventDestroy_v2(e) }) {
            release_failed("an event", d);
        }
        return Err(err);
    }
    Ok((Event(e), h.reserved.map(|b| b as u8)))
}

/// Opens another process's interprocess event from its IPC handle. The caller owns the result
/// (destroyed with `cuEventDestroy_v2`); the device's context must be current.
pub(crate) fn open_ipc_event(handle: &[u8; 64]) -> Result<Event, GpuError> {
    let handle = sys::CUipcEventHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut e: sys::CUevent = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the caller made the context current.
    check("cuIpcOpenEventHandle", unsafe {
        sys::cuIpcOpenEventHandle(&mut e, handle)
    })?;
    Ok(Event(e))
}

/// A device's primary context, retained for as long as this value lives.
#[derive(Debug)]
pub struct PrimaryContext {
    pub(crate) dev: sys::CUdevice,
    pub(crate) ctx: Context,
}

impl PrimaryContext {
    /// Retains the primary context of device `ordinal`.
    pub(crate) fn retain(ordinal: i32) -> Result<Self, GpuError> {
        available()?;
        let mut dev: sys::CUdevice = 0;
        // SAFETY: out-pointer to a local; the driver is initialised.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; `dev` is a valid device.
        check("cuDevicePrimaryCtxRetain", unsafe {
            sys::cuDevicePrimaryCtxRetain(&mut ctx, dev)
        })?;
        Ok(PrimaryContext {
            dev,
            ctx: Context(ctx),
        })
    }

    /// Retains the primary context of device `ordinal` for kvd itself, and makes it current.
    /// kvd runs no kernels, so it needs no per-thread stack, yet the driver reserves its default
    /// 1 KiB for every thread the GPU can hold unless told otherwise. Never call this in a
    /// client: the primary context is shared with everything else in that process.
    pub(crate) fn retain_for_copies(ordinal: i32) -> Result<Self, GpuError> {
        let primary = Self::retain(ordinal)?;
        primary.make_current()?;
        // SAFETY: the context was just made current on this thread.
        let r = unsafe { sys::cuCtxSetLimit(sys::CUlimit::CU_LIMIT_STACK_SIZE, 0) };
        if let Err(e) = check("cuCtxSetLimit(CU_LIMIT_STACK_SIZE)", r) {
            // Only memory is at stake: the driver keeps its default.
            tracing::info!(ordinal, "{e}; keeping the driver's default stack size");
        }
        Ok(primary)
    }

    /// Makes the context current on the calling thread.
    pub(crate) fn make_current(&self) -> Result<(), GpuError> {
        // SAFETY: `ctx` is retained for the life of `self`.
        self.ctx.make_current()
    }
}

impl Context {
    /// Makes the context current on the calling thread. The caller keeps it retained.
    pub(crate) fn make_current(self) -> Result<(), GpuError> {
        // SAFETY: the context is retained by the caller (a live PrimaryContext).
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.0) })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        // SAFETY: balances the retain in `retain`.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        if let Err(e) = check("cuDevicePrimaryCtxRelease_v2", r) {
            release_failed("a primary context", e);
        }
    }
}
