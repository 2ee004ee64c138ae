//! Raw declarations of the HIP runtime entry points kvd calls, loaded with `dlopen` at run time
//! so that building kvd needs no ROCm (as cudarc's `dynamic-loading` does for CUDA).
//!
//! Written here rather than taken from a bindings crate: `hip-sys` (the design card's pick)
//! links `libamdhip64` at build time, which would make ROCm a build dependency, and binds the
//! whole API where kvd needs about forty calls. Each entry point is declared once, in
//! `hip_api!`, with its C prototype beside the Rust one; `hip::abi` turns those prototypes into a
//! C++ file that CI compiles against ROCm's own `hip_runtime_api.h`, so a declaration that
//! drifts from the headers fails the build instead of corrupting a call.
//!
//! Types follow the AMD headers (`hipDeviceptr_t` and `hipMemGenericAllocationHandle_t` are
//! pointers there; on HIP's NVIDIA platform they are 64-bit integers, which the x86-64 and
//! aarch64 calling conventions pass the same way).

#![allow(non_camel_case_types, non_upper_case_globals, non_snake_case)]

use std::ffi::{c_char, c_int, c_uint, c_ulonglong, c_void};

/// `hipError_t`.
pub type hipError_t = c_int;
/// `hipDevice_t`.
pub type hipDevice_t = c_int;
/// `hipStream_t`.
pub type hipStream_t = *mut c_void;
/// `hipEvent_t`.
pub type hipEvent_t = *mut c_void;
/// `hipDeviceptr_t`.
pub type hipDeviceptr_t = *mut c_void;
/// `hipMemGenericAllocationHandle_t`.
pub type hipMemGenericAllocationHandle_t = *mut c_void;
/// `hipMemcpyKind`.
pub type hipMemcpyKind = c_int;
/// `hipPointer_attribute`.
pub type hipPointer_attribute = c_int;
/// `hipMemAllocationHandleType`.
pub type hipMemAllocationHandleType = c_int;

/// `hipSuccess`.
pub const hipSuccess: hipError_t = 0;
/// `hipErrorInvalidValue`.
pub const hipErrorInvalidValue: hipError_t = 1;
/// `hipErrorOutOfMemory`.
pub const hipErrorOutOfMemory: hipError_t = 2;
/// `hipErrorNoDevice`.
pub const hipErrorNoDevice: hipError_t = 100;
/// `hipErrorAlreadyMapped`.
pub const hipErrorAlreadyMapped: hipError_t = 208;
/// `hipErrorInvalidHandle`.
pub const hipErrorInvalidHandle: hipError_t = 400;
/// `hipErrorNotReady`: an event or stream has work still running.
pub const hipErrorNotReady: hipError_t = 600;
/// `hipErrorHostMemoryAlreadyRegistered`.
pub const hipErrorHostMemoryAlreadyRegistered: hipError_t = 712;
/// `hipErrorNotSupported`.
pub const hipErrorNotSupported: hipError_t = 801;

/// `hipEventBlockingSync`.
pub const hipEventBlockingSync: c_uint = 0x1;
/// `hipEventDisableTiming`.
pub const hipEventDisableTiming: c_uint = 0x2;
/// `hipEventInterprocess`.
pub const hipEventInterprocess: c_uint = 0x4;
/// `hipStreamNonBlocking`.
pub const hipStreamNonBlocking: c_uint = 0x1;
/// `hipHostRegisterPortable`.
pub const hipHostRegisterPortable: c_uint = 0x1;
/// `hipHostRegisterMapped`.
pub const hipHostRegisterMapped: c_uint = 0x2;
/// `hipIpcMemLazyEnablePeerAccess`. Its value differs by platform (0 in AMD's headers, 1 —
/// CUDA's — on the NVIDIA platform), so it is a macro in C and the forwarding library maps it.
pub const hipIpcMemLazyEnablePeerAccess: c_uint = 0;
/// `hipMemcpyDefault`: the runtime infers the direction from unified addresses.
pub const hipMemcpyDefault: hipMemcpyKind = 4;
/// `HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
pub const HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL: hipPointer_attribute = 9;
/// `HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE` (ROCm documents it as unsupported on AMD
/// GPUs, so kvd falls back to probing for a VMM allocation handle).
pub const HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE: hipPointer_attribute = 10;
/// `hipMemHandleTypePosixFileDescriptor`.
pub const hipMemHandleTypePosixFileDescriptor: hipMemAllocationHandleType = 1;
/// `hipMemLocationTypeDevice`.
pub const hipMemLocationTypeDevice: c_int = 1;
/// `hipMemAccessFlagsProtReadWrite`.
pub const hipMemAccessFlagsProtReadWrite: c_int = 3;
/// `hipMemAllocationTypePinned`.
pub const hipMemAllocationTypePinned: c_int = 1;

/// Size of `hipIpcMemHandle_t` and `hipIpcEventHandle_t`.
pub const HIP_IPC_HANDLE_SIZE: usize = 64;

/// `hipIpcMemHandle_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipIpcMemHandle_t {
    /// Opaque bytes.
    pub reserved: [c_char; HIP_IPC_HANDLE_SIZE],
}

/// `hipIpcEventHandle_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipIpcEventHandle_t {
    /// Opaque bytes.
    pub reserved: [c_char; HIP_IPC_HANDLE_SIZE],
}

/// `hipUUID`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipUUID {
    /// Sixteen bytes, the same in every process.
    pub bytes: [c_char; 16],
}

/// `hipMemLocation`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemLocation {
    /// `hipMemLocationType`.
    pub type_: c_int,
    /// Device ordinal.
    pub id: c_int,
}

/// `hipMemAccessDesc`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemAccessDesc {
    /// Where the access applies.
    pub location: hipMemLocation,
    /// `hipMemAccessFlags`.
    pub flags: c_int,
}

/// `hipMemAllocationProp` as ROCm 6.0 and later lay it out (the same as CUDA's
/// `CUmemAllocationProp`). ROCm 5.x used another layout; kvd's server never passes this struct
/// (it imports VMM memory without it), only the test buffers of `crate::runtime::buffers` do (through `Hip::mem_create`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct hipMemAllocationProp {
    /// `hipMemAllocationType`.
    pub type_: c_int,
    /// `hipMemAllocationHandleType` the allocation may be exported as.
    pub requestedHandleType: hipMemAllocationHandleType,
    /// Where the memory lives.
    pub location: hipMemLocation,
    /// Windows only.
    pub win32HandleMetaData: *mut c_void,
    /// `allocFlags.compressionType`.
    pub compressionType: u8,
    /// `allocFlags.gpuDirectRDMACapable`.
    pub gpuDirectRDMACapable: u8,
    /// `allocFlags.usage`.
    pub usage: u16,
}

/// Declares the entry points: the `Api` table of function pointers, its loader, and
/// `C_PROTOTYPES` for the header check.
macro_rules! hip_api {
    ($( fn $name:ident($($arg:ident: $ty:ty),* $(,)?) -> $ret:ty = $cret:literal $cargs:literal; )*) => {
        /// The HIP runtime's entry points that kvd calls, resolved from one loaded library.
        #[allow(non_snake_case)]
        pub struct Api {
            $(
                #[doc = concat!("`", $cret, " ", stringify!($name), $cargs, "`")]
                pub $name: unsafe extern "C" fn($($ty),*) -> $ret,
            )*
            _lib: libloading::Library,
        }

        impl std::fmt::Debug for Api {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct("Api").field("lib", &self._lib).finish_non_exhaustive()
            }
        }

        impl Api {
            /// Resolves every entry point from `lib`.
            ///
            /// # Safety
            /// `lib` must be a HIP runtime whose symbols have the C prototypes declared here
            /// (what the header check establishes for ROCm's).
            pub unsafe fn resolve(lib: libloading::Library) -> Result<Self, String> {
                $(
                    // SAFETY: the caller guarantees the symbol has this prototype.
                    let $name = *unsafe {
                        lib.get::<unsafe extern "C" fn($($ty),*) -> $ret>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                    }
                    .map_err(|e| format!("{}: {e}", stringify!($name)))?;
                )*
                Ok(Api { $($name,)* _lib: lib })
            }
        }

        /// (name, C return type, C parameter list) of each entry point.
        pub const C_PROTOTYPES: &[(&str, &str, &str)] = &[$((stringify!($name), $cret, $cargs)),*];
    };
}

hip_api! {
    fn hipGetErrorName(e: hipError_t) -> *const c_char = "const char*" "(hipError_t)";
    fn hipGetErrorString(e: hipError_t) -> *const c_char = "const char*" "(hipError_t)";
    fn hipInit(flags: c_uint) -> hipError_t = "hipError_t" "(unsigned int)";
    fn hipRuntimeGetVersion(v: *mut c_int) -> hipError_t = "hipError_t" "(int*)";
    fn hipGetDeviceCount(n: *mut c_int) -> hipError_t = "hipError_t" "(int*)";
    fn hipDeviceGet(d: *mut hipDevice_t, ordinal: c_int) -> hipError_t
        = "hipError_t" "(hipDevice_t*, int)";
    fn hipDeviceGetUuid(u: *mut hipUUID, d: hipDevice_t) -> hipError_t
        = "hipError_t" "(hipUUID*, hipDevice_t)";
    fn hipDeviceGetName(name: *mut c_char, len: c_int, d: hipDevice_t) -> hipError_t
        = "hipError_t" "(char*, int, hipDevice_t)";
    fn hipSetDevice(ordinal: c_int) -> hipError_t = "hipError_t" "(int)";
    fn hipDeviceSynchronize() -> hipError_t = "hipError_t" "(void)";
    fn hipMemGetInfo(free: *mut usize, total: *mut usize) -> hipError_t
        = "hipError_t" "(size_t*, size_t*)";
    fn hipMalloc(p: *mut *mut c_void, size: usize) -> hipError_t = "hipError_t" "(void**, size_t)";
    fn hipFree(p: *mut c_void) -> hipError_t = "hipError_t" "(void*)";
    fn hipHostRegister(p: *mut c_void, size: usize, flags: c_uint) -> hipError_t
        = "hipError_t" "(void*, size_t, unsigned int)";
    fn hipHostUnregister(p: *mut c_void) -> hipError_t = "hipError_t" "(void*)";
    fn hipPointerGetAttribute(data: *mut c_void, attr: hipPointer_attribute, p: hipDeviceptr_t)
        -> hipError_t = "hipError_t" "(void*, hipPointer_attribute, hipDeviceptr_t)";
    fn hipMemGetAddressRange(base: *mut hipDeviceptr_t, size: *mut usize, p: hipDeviceptr_t)
        -> hipError_t = "hipError_t" "(hipDeviceptr_t*, size_t*, hipDeviceptr_t)";
    fn hipIpcGetMemHandle(h: *mut hipIpcMemHandle_t, p: *mut c_void) -> hipError_t
        = "hipError_t" "(hipIpcMemHandle_t*, void*)";
    fn hipIpcOpenMemHandle(p: *mut *mut c_void, h: hipIpcMemHandle_t, flags: c_uint)
        -> hipError_t = "hipError_t" "(void**, hipIpcMemHandle_t, unsigned int)";
    fn hipIpcCloseMemHandle(p: *mut c_void) -> hipError_t = "hipError_t" "(void*)";
    fn hipEventCreateWithFlags(e: *mut hipEvent_t, flags: c_uint) -> hipError_t
        = "hipError_t" "(hipEvent_t*, unsigned)";
    fn hipEventDestroy(e: hipEvent_t) -> hipError_t = "hipError_t" "(hipEvent_t)";
    fn hipEventRecord(e: hipEvent_t, s: hipStream_t) -> hipError_t
        = "hipError_t" "(hipEvent_t, hipStream_t)";
    fn hipEventQuery(e: hipEvent_t) -> hipError_t = "hipError_t" "(hipEvent_t)";
    fn hipEventSynchronize(e: hipEvent_t) -> hipError_t = "hipError_t" "(hipEvent_t)";
    fn hipIpcGetEventHandle(h: *mut hipIpcEventHandle_t, e: hipEvent_t) -> hipError_t
        = "hipError_t" "(hipIpcEventHandle_t*, hipEvent_t)";
    fn hipIpcOpenEventHandle(e: *mut hipEvent_t, h: hipIpcEventHandle_t) -> hipError_t
        = "hipError_t" "(hipEvent_t*, hipIpcEventHandle_t)";
    fn hipStreamCreateWithFlags(s: *mut hipStream_t, flags: c_uint) -> hipError_t
        = "hipError_t" "(hipStream_t*, unsigned int)";
    fn hipStreamDestroy(s: hipStream_t) -> hipError_t = "hipError_t" "(hipStream_t)";
    fn hipStreamWaitEvent(s: hipStream_t, e: hipEvent_t, flags: c_uint) -> hipError_t
        = "hipError_t" "(hipStream_t, hipEvent_t, unsigned int)";
    fn hipMemcpy(dst: *mut c_void, src: *const c_void, n: usize, kind: hipMemcpyKind)
        -> hipError_t = "hipError_t" "(void*, const void*, size_t, hipMemcpyKind)";
    fn hipMemcpyAsync(
        dst: *mut c_void, src: *const c_void, n: usize, kind: hipMemcpyKind, s: hipStream_t
    ) -> hipError_t = "hipError_t" "(void*, const void*, size_t, hipMemcpyKind, hipStream_t)";
    fn hipMemsetD8Async(p: hipDeviceptr_t, v: u8, n: usize, s: hipStream_t) -> hipError_t
        = "hipError_t" "(hipDeviceptr_t, unsigned char, size_t, hipStream_t)";
    fn hipMemCreate(
        h: *mut hipMemGenericAllocationHandle_t, size: usize, prop: *const hipMemAllocationProp,
        flags: c_ulonglong
    ) -> hipError_t = "hipError_t"
        "(hipMemGenericAllocationHandle_t*, size_t, const hipMemAllocationProp*, unsigned long long)";
    fn hipMemRelease(h: hipMemGenericAllocationHandle_t) -> hipError_t
        = "hipError_t" "(hipMemGenericAllocationHandle_t)";
    fn hipMemRetainAllocationHandle(h: *mut hipMemGenericAllocationHandle_t, p: *mut c_void)
        -> hipError_t = "hipError_t" "(hipMemGenericAllocationHandle_t*, void*)";
    fn hipMemExportToShareableHandle(
        out: *mut c_void, h: hipMemGenericAllocationHandle_t, t: hipMemAllocationHandleType,
        flags: c_ulonglong
    ) -> hipError_t = "hipError_t"
        "(void*, hipMemGenericAllocationHandle_t, hipMemAllocationHandleType, unsigned long long)";
    fn hipMemImportFromShareableHandle(
        h: *mut hipMemGenericAllocationHandle_t, os: *mut c_void, t: hipMemAllocationHandleType
    ) -> hipError_t = "hipError_t"
        "(hipMemGenericAllocationHandle_t*, void*, hipMemAllocationHandleType)";
    fn hipMemAddressReserve(
        p: *mut *mut c_void, size: usize, align: usize, addr: *mut c_void, flags: c_ulonglong
    ) -> hipError_t = "hipError_t" "(void**, size_t, size_t, void*, unsigned long long)";
    fn hipMemAddressFree(p: *mut c_void, size: usize) -> hipError_t
        = "hipError_t" "(void*, size_t)";
    fn hipMemMap(
        p: *mut c_void, size: usize, offset: usize, h: hipMemGenericAllocationHandle_t,
        flags: c_ulonglong
    ) -> hipError_t = "hipError_t"
        "(void*, size_t, size_t, hipMemGenericAllocationHandle_t, unsigned long long)";
    fn hipMemUnmap(p: *mut c_void, size: usize) -> hipError_t = "hipError_t" "(void*, size_t)";
    fn hipMemSetAccess(p: *mut c_void, size: usize, desc: *const hipMemAccessDesc, n: usize)
        -> hipError_t = "hipError_t" "(void*, size_t, const hipMemAccessDesc*, size_t)";
}

/// Struct sizes and constants the header check compares with ROCm's, as (C expression, value).
pub fn c_layout_checks() -> Vec<(&'static str, u64)> {
    use std::mem::size_of;
    vec![
        (
            "sizeof(hipIpcMemHandle_t)",
            size_of::<hipIpcMemHandle_t>() as u64,
        ),
        (
            "sizeof(hipIpcEventHandle_t)",
            size_of::<hipIpcEventHandle_t>() as u64,
        ),
        ("sizeof(hipUUID)", size_of::<hipUUID>() as u64),
        ("sizeof(hipMemLocation)", size_of::<hipMemLocation>() as u64),
        (
            "sizeof(hipMemAccessDesc)",
            size_of::<hipMemAccessDesc>() as u64,
        ),
        ("sizeof(hipError_t)", size_of::<hipError_t>() as u64),
        ("sizeof(hipDeviceptr_t)", size_of::<hipDeviceptr_t>() as u64),
        (
            "sizeof(hipMemGenericAllocationHandle_t)",
            size_of::<hipMemGenericAllocationHandle_t>() as u64,
        ),
        ("hipSuccess", hipSuccess as u64),
        ("hipErrorInvalidValue", hipErrorInvalidValue as u64),
        ("hipErrorOutOfMemory", hipErrorOutOfMemory as u64),
        ("hipErrorNoDevice", hipErrorNoDevice as u64),
        ("hipErrorAlreadyMapped", hipErrorAlreadyMapped as u64),
        ("hipErrorInvalidHandle", hipErrorInvalidHandle as u64),
        ("hipErrorNotReady", hipErrorNotReady as u64),
        (
            "hipErrorHostMemoryAlreadyRegistered",
            hipErrorHostMemoryAlreadyRegistered as u64,
        ),
        ("hipErrorNotSupported", hipErrorNotSupported as u64),
        ("hipEventBlockingSync", hipEventBlockingSync as u64),
        ("hipEventDisableTiming", hipEventDisableTiming as u64),
        ("hipEventInterprocess", hipEventInterprocess as u64),
        ("hipStreamNonBlocking", hipStreamNonBlocking as u64),
        ("hipHostRegisterPortable", hipHostRegisterPortable as u64),
        ("hipHostRegisterMapped", hipHostRegisterMapped as u64),
        (
            "hipIpcMemLazyEnablePeerAccess",
            hipIpcMemLazyEnablePeerAccess as u64,
        ),
        ("hipMemcpyDefault", hipMemcpyDefault as u64),
        (
            "HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL",
            HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL as u64,
        ),
        (
            "HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE",
            HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE as u64,
        ),
        (
            "hipMemHandleTypePosixFileDescriptor",
            hipMemHandleTypePosixFileDescriptor as u64,
        ),
        ("hipMemLocationTypeDevice", hipMemLocationTypeDevice as u64),
        (
            "hipMemAccessFlagsProtReadWrite",
            hipMemAccessFlagsProtReadWrite as u64,
        ),
        (
            "hipMemAllocationTypePinned",
            hipMemAllocationTypePinned as u64,
        ),
        ("HIP_IPC_HANDLE_SIZE", HIP_IPC_HANDLE_SIZE as u64),
    ]
}
