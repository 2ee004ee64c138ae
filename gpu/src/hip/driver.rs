//! The `result` layer over [`super::sys`]: loading the HIP runtime once without panicking,
//! turning `hipError_t` into [`GpuError`] with the call's name and the operator's fix, and the
//! driver handles kvd keeps (streams, events) as newtypes that may cross threads.
//!
//! HIP's runtime API has no contexts to retain: a thread chooses its device with
//! `hipSetDevice`, and every call below that touches a device is preceded by one
//! (`set_device`) on the thread that makes it.

use std::ffi::{c_char, c_void, CStr};
use std::sync::OnceLock;

use super::sys::{self, hipError_t, Api};
pub(crate) use crate::error::release_failed;
use crate::error::GpuError;

/// Library names tried in order, unless `KVD_HIP_LIBRARY` (a path or name) names the one to
/// load. ROCm 6 and 7 ship `libamdhip64.so.6`/`.so.7`; the unversioned name needs the dev package.
const LIBRARY_NAMES: &[&str] = &[
    "libamdhip64.so.7",
    "libamdhip64.so.6",
    "libamdhip64.so.5",
    "libamdhip64.so",
];

static API: OnceLock<Result<(Api, String), String>> = OnceLock::new();

/// `RTLD_NOLOAD` (glibc and musl): `dlopen` returns a library only if it is already loaded.
const RTLD_NOLOAD: std::ffi::c_int = 0x4;
use libloading::os::unix::RTLD_LAZY;

fn load() -> Result<(Api, String), String> {
    // An operator's explicit choice is the only one tried: falling back to another runtime
    // would hide the mistake.
    let names: Vec<String> = match std::env::var_os("KVD_HIP_LIBRARY") {
        Some(p) => vec![p.to_string_lossy().into_owned()],
        None => LIBRARY_NAMES.iter().map(|s| s.to_string()).collect(),
    };
    // Libraries that are not there at all, named once together; libraries that are there but
    // failed (a missing dependency), each with dlerror()'s reason.
    let mut absent: Vec<&str> = Vec::new();
    let mut tried = Vec::new();
    // A runtime this process already holds comes first: in vLLM's process that is the one
    // PyTorch loaded, and the streams PyTorch hands the connector belong to it (a second HIP
    // runtime, say ROCm 7's beside a wheel's ROCm 6, would not know them).
    let loaded = names.iter().find_map(|name| {
        // SAFETY: RTLD_NOLOAD only looks up a library that is already loaded; it runs no
        // initialisers.
        unsafe { libloading::os::unix::Library::open(Some(name), RTLD_NOLOAD | RTLD_LAZY) }
            .ok()
            .map(|lib| (libloading::Library::from(lib), name))
    });
    let candidates = loaded.into_iter().chain(names.iter().filter_map(|name| {
        // SAFETY: loading a shared library runs its initialisers; the HIP runtime's are meant
        // to run in any process that links it.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => Some((lib, name)),
            Err(e) => {
                // libloading keeps dlerror()'s text (which dependency is missing) in the source;
                // it begins with the name that could not be opened.
                let why =
                    std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
                if why.starts_with(&format!("{name}: cannot open shared object file")) {
                    absent.push(name);
                } else if why.starts_with(name.as_str()) {
                    tried.push(why);
                } else {
                    tried.push(format!("{name}: {why}"));
                }
                None
            }
        }
    }));
    if let Some((lib, name)) = candidates.into_iter().next() {
        // SAFETY: a library with this name is a HIP runtime, whose entry points have the
        // prototypes declared in sys (checked against ROCm's headers in CI).
        let api = unsafe { Api::resolve(lib) }
            .map_err(|e| format!("{name} lacks an entry point kvd needs: {e}"))?;
        // SAFETY: hipInit(0) is the documented first call; the pointer came from `lib`.
        let r = unsafe { (api.hipInit)(0) };
        check_with(&api, "hipInit", r).map_err(|e| e.to_string())?;
        return Ok((api, name.clone()));
    }
    let failed = tried.len();
    if !absent.is_empty() {
        tried.insert(0, format!("{} not found", absent.join(", ")));
    }
    if std::env::var_os("KVD_HIP_LIBRARY").is_some() {
        return Err(format!(
            "KVD_HIP_LIBRARY names a HIP runtime that could not be loaded ({})",
            tried.join("; ")
        ));
    }
    if failed == 0 {
        return Err(format!("no ROCm on this machine ({})", tried.join("; ")));
    }
    Err(format!(
        "the HIP runtime could not be loaded ({})",
        tried.join("; ")
    ))
}

/// Whether the HIP runtime could be loaded and initialised; decided once.
pub fn available() -> Result<(), GpuError> {
    api().map(|_| ())
}

/// The path or name of the HIP runtime library that was loaded.
pub fn library() -> Result<String, GpuError> {
    API.get_or_init(load)
        .as_ref()
        .map(|(_, name)| name.clone())
        .map_err(|e| GpuError::Unavailable(e.clone()))
}

/// The loaded entry points.
pub(crate) fn api() -> Result<&'static Api, GpuError> {
    API.get_or_init(load)
        .as_ref()
        .map(|(api, _)| api)
        .map_err(|e| GpuError::Unavailable(e.clone()))
}

pub(crate) fn c_str(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the runtime returns NUL-terminated static strings.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Hints that name the fix for the errors operators meet.
fn hint(call: &str, r: hipError_t) -> &'static str {
    match (call, r) {
        ("hipIpcGetMemHandle", sys::hipErrorInvalidValue) => {
            "; the memory is probably a VMM allocation (expandable_segments:True or vLLM's cumem \
             allocator), which legacy HIP IPC cannot share: register it by file descriptor"
        }
        ("hipIpcOpenMemHandle", sys::hipErrorInvalidValue | sys::hipErrorInvalidHandle) => {
            "; the exporting process may have exited or freed the memory, or kvd and the client \
             do not see the same GPU"
        }
        ("hipIpcOpenMemHandle", sys::hipErrorAlreadyMapped) => {
            "; this allocation is already mapped by this kvd"
        }
        (_, sys::hipErrorOutOfMemory) => "; the GPU or host is out of memory",
        (_, sys::hipErrorNotSupported) => {
            "; this ROCm version or the container does not allow this (check that kvd sees \
             /dev/kfd and /dev/dri and the GPUs)"
        }
        (_, sys::hipErrorHostMemoryAlreadyRegistered) => "; the pool is already pinned",
        _ => "",
    }
}

fn check_with(api: &Api, call: &'static str, r: hipError_t) -> Result<(), GpuError> {
    if r == sys::hipSuccess {
        return Ok(());
    }
    // SAFETY: both functions take any error code and return static strings (or null).
    let (name, message) = unsafe { ((api.hipGetErrorName)(r), (api.hipGetErrorString)(r)) };
    Err(GpuError::Driver {
        call,
        name: c_str(name).unwrap_or_else(|| format!("hipError {r}")),
        message: c_str(message).unwrap_or_else(|| "no description".into()),
        hint: hint(call, r).to_string(),
    })
}

/// Turns a `hipError_t` into a `Result`, naming the call. Call only after [`available`].
pub(crate) fn check(call: &'static str, r: hipError_t) -> Result<(), GpuError> {
    check_with(api()?, call, r)
}

/// Makes device `ordinal` the calling thread's current device.
pub(crate) fn set_device(ordinal: i32) -> Result<(), GpuError> {
    let api = api()?;
    // SAFETY: any ordinal is accepted and checked by the runtime.
    check("hipSetDevice", unsafe { (api.hipSetDevice)(ordinal) })
}

/// A `hipStream_t` of kvd's own or of a client (as PyTorch passes it).
#[derive(Debug, Clone, Copy)]
pub struct Stream(pub(crate) sys::hipStream_t);

// SAFETY: an opaque runtime handle; the runtime serialises work submitted to one stream, and
// kvd submits to each of its streams from one thread only.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

/// A `hipEvent_t`: kvd's completion events and both sides' interprocess events.
#[derive(Debug, Clone, Copy)]
pub struct Event(pub(crate) sys::hipEvent_t);

// SAFETY: an opaque runtime handle, usable from any thread of the process; recording and
// querying are thread-safe in the runtime. Owners destroy each event once, in Drop.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

/// A device address (`hipDeviceptr_t`), as an integer so that offsets are plain arithmetic.
pub(crate) type DevicePtr = u64;

/// Creates an interprocess event (timing off) and exports its IPC handle. The caller owns the
/// event (destroy it with [`destroy_event`]); the device must be current.
pub(crate) fn create_ipc_event() -> Result<(Event, [u8; 64]), GpuError> {
    let api = api()?;
    let mut e: sys::hipEvent_t = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the caller made the device current.
    check("hipEventCreateWithFlags", unsafe {
        (api.hipEventCreateWithFlags)(
            &mut e,
            sys::hipEventInterprocess | sys::hipEventDisableTiming,
        )
    })?;
    let mut h = sys::hipIpcEventHandle_t { reserved: [0; 64] };
    // SAFETY: `e` is an interprocess event just created; out-pointer to a local.
    let r = unsafe { (api.hipIpcGetEventHandle)(&mut h, e) };
    if let Err(err) = check("hipIpcGetEventHandle", r) {
        destroy_event(Event(e), "an event");
        return Err(err);
    }
    Ok((Event(e), h.reserved.map(|b| b as u8)))
}

/// Opens another process's interprocess event from its IPC handle. The caller owns the result
/// (destroyed with [`destroy_event`]); the device must be current.
pub(crate) fn open_ipc_event(handle: &[u8; 64]) -> Result<Event, GpuError> {
    let api = api()?;
    let h = sys::hipIpcEventHandle_t {
        reserved: handle.map(|b| b as c_char),
    };
    let mut e: sys::hipEvent_t = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; the handle is passed by value.
    check("hipIpcOpenEventHandle", unsafe {
        (api.hipIpcOpenEventHandle)(&mut e, h)
    })?;
    Ok(Event(e))
}

/// Destroys an event created or opened by this process, once; failures are logged and counted.
pub(crate) fn destroy_event(e: Event, what: &str) {
    let r = api().and_then(|api| {
        // SAFETY: the caller owns `e` and never uses it again.
        check("hipEventDestroy", unsafe { (api.hipEventDestroy)(e.0) })
    });
    if let Err(err) = r {
        release_failed(what, err);
    }
}

/// A device pointer as the runtime's `void*`.
pub(crate) fn void_ptr(p: DevicePtr) -> *mut c_void {
    p as usize as *mut c_void
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_name_the_fix_for_the_errors_operators_meet() {
        assert!(hint("hipIpcGetMemHandle", sys::hipErrorInvalidValue).contains("file descriptor"));
        assert!(hint("hipIpcOpenMemHandle", sys::hipErrorInvalidHandle).contains("exited"));
        assert!(hint("hipHostRegister", sys::hipErrorNotSupported).contains("/dev/kfd"));
        assert_eq!(hint("hipMemcpyAsync", sys::hipErrorInvalidValue), "");
    }
}
