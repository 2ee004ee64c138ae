//! [`Hip`]: the [`Runtime`] trait on HIP's runtime API, each method one call through the
//! entry points of [`super::sys`] checked by [`check`]. HIP has no contexts to retain: a thread
//! chooses its device with `hipSetDevice`, which is all [`Runtime::make_current`] does here.

use std::ffi::{c_char, c_void};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use super::driver::{self, api, c_str, check, set_device, void_ptr, Event, Stream};
use super::sys;
use crate::copy::Direction;
use crate::error::GpuError;
use crate::runtime::Runtime;
use crate::types::{format_nvidia_uuid, IPC_HANDLE_BYTES};

/// AMD's HIP runtime (`libamdhip64.so`), or HIP's NVIDIA platform in kvd's tests; loaded at
/// run time.
#[derive(Debug)]
pub struct Hip;

/// A HIP device in use: its ordinal, made current with `hipSetDevice`. HIP retains nothing.
#[derive(Debug, Clone, Copy)]
pub struct HipContext(i32);

/// Granularity of VMM test buffers: 2 MiB, a multiple of every GPU's minimum (kvd never asks
/// the runtime, whose `hipMemAllocationProp` changed layout in ROCm 6.0).
const TEST_GRANULARITY_BYTES: u64 = 2 << 20;

fn attribute(ptr: u64, attr: sys::hipPointer_attribute) -> Result<i32, GpuError> {
    let api = api()?;
    let mut v: i32 = 0;
    // SAFETY: both attributes asked for here are 32-bit integers; out-pointer to a local.
    let r =
        unsafe { (api.hipPointerGetAttribute)((&mut v as *mut i32).cast(), attr, void_ptr(ptr)) };
    check("hipPointerGetAttribute", r)?;
    Ok(v)
}

fn location(ordinal: i32) -> sys::hipMemLocation {
    sys::hipMemLocation {
        type_: sys::hipMemLocationTypeDevice,
        id: ordinal,
    }
}

impl Runtime for Hip {
    const NAME: &'static str = "HIP";
    const LABEL: &'static str = "hip";
    const DRIVER: &'static str = "the HIP runtime";
    const VISIBILITY_FIX: &'static str = "unset HIP_VISIBLE_DEVICES/ROCR_VISIBLE_DEVICES for \
        kvd, or give its container /dev/kfd and every /dev/dri render node";
    const COPY_CALL: &'static str = "hipMemcpyAsync";
    const EXPORT_FIX: &'static str = "; this VMM memory was allocated without an exportable \
        handle type: run vLLM with PyTorch's expandable_segments:True instead, or without its \
        cumem allocator";

    type Context = HipContext;
    type Stream = Stream;
    type Event = Event;
    type AllocHandle = sys::hipMemGenericAllocationHandle_t;

    fn available() -> Result<(), GpuError> {
        driver::available()
    }

    fn device_count() -> Result<i32, GpuError> {
        let api = api()?;
        let mut n = 0;
        // SAFETY: out-pointer to a local.
        match unsafe { (api.hipGetDeviceCount)(&mut n) } {
            sys::hipErrorNoDevice => Ok(0),
            r => check("hipGetDeviceCount", r).map(|()| n),
        }
    }

    fn device_identity(ordinal: i32) -> Result<([u8; 16], String), GpuError> {
        let api = api()?;
        let mut dev: sys::hipDevice_t = 0;
        // SAFETY: out-pointer to a local.
        check("hipDeviceGet", unsafe {
            (api.hipDeviceGet)(&mut dev, ordinal)
        })?;
        let mut uuid = sys::hipUUID { bytes: [0; 16] };
        // SAFETY: out-pointer to a local hipUUID.
        check("hipDeviceGetUuid", unsafe {
            (api.hipDeviceGetUuid)(&mut uuid, dev)
        })?;
        let mut name = [0 as c_char; 128];
        // SAFETY: the buffer holds 128 bytes, as passed.
        check("hipDeviceGetName", unsafe {
            (api.hipDeviceGetName)(name.as_mut_ptr(), 128, dev)
        })?;
        name[127] = 0;
        let name = c_str(name.as_ptr()).unwrap_or_default();
        Ok((uuid.bytes.map(|b| b as u8), name))
    }

    fn pci_bus_id(_ordinal: i32) -> Option<Result<String, GpuError>> {
        None
    }

    /// On AMD GPUs `hipDeviceGetUuid` gives sixteen ASCII characters (the unique id
    /// `rocm-smi --showuniqueid` prints), shown as such; on HIP's NVIDIA platform it gives
    /// NVIDIA's UUID, shown as nvidia-smi does.
    fn format_uuid(u: &[u8; 16]) -> String {
        if u.iter().all(|b| b.is_ascii_alphanumeric()) {
            return format!("GPU-{}", String::from_utf8_lossy(u));
        }
        format_nvidia_uuid(u)
    }

    fn retain(ordinal: i32) -> Result<HipContext, GpuError> {
        Ok(HipContext(ordinal))
    }

    fn make_current(ctx: &HipContext) -> Result<(), GpuError> {
        set_device(ctx.0)
    }

    unsafe fn host_register(ptr: *mut c_void, len: usize) -> Result<(), GpuError> {
        let api = api()?;
        let flags = sys::hipHostRegisterPortable | sys::hipHostRegisterMapped;
        // SAFETY: the caller passes a live mapping registered with no other range.
        check("hipHostRegister", unsafe {
            (api.hipHostRegister)(ptr, len, flags)
        })
    }

    unsafe fn host_unregister(ptr: *mut c_void) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller registered `ptr` and unregisters it once.
        check("hipHostUnregister", unsafe { (api.hipHostUnregister)(ptr) })
    }

    fn stream_create() -> Result<Stream, GpuError> {
        let api = api()?;
        let mut st: sys::hipStream_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the caller made the device current.
        check("hipStreamCreateWithFlags", unsafe {
            (api.hipStreamCreateWithFlags)(&mut st, sys::hipStreamNonBlocking)
        })?;
        Ok(Stream(st))
    }

    unsafe fn stream_destroy(s: Stream) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller created `s` and destroys it once.
        check("hipStreamDestroy", unsafe { (api.hipStreamDestroy)(s.0) })
    }

    fn stream_from_raw(raw: u64) -> Stream {
        Stream(raw as usize as sys::hipStream_t)
    }

    fn ipc_event_create() -> Result<(Event, [u8; IPC_HANDLE_BYTES]), GpuError> {
        driver::create_ipc_event()
    }

    fn ipc_event_open(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<Event, GpuError> {
        driver::open_ipc_event(handle)
    }

    fn done_event_create() -> Result<Event, GpuError> {
        let api = api()?;
        let mut e: sys::hipEvent_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the caller made the device current.
        check("hipEventCreateWithFlags", unsafe {
            (api.hipEventCreateWithFlags)(
                &mut e,
                sys::hipEventBlockingSync | sys::hipEventDisableTiming,
            )
        })?;
        Ok(Event(e))
    }

    unsafe fn event_destroy(e: Event) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller owns `e` and never uses it again.
        check("hipEventDestroy", unsafe { (api.hipEventDestroy)(e.0) })
    }

    unsafe fn event_record(e: Event, s: Stream) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller passes live handles of the current device.
        check("hipEventRecord", unsafe { (api.hipEventRecord)(e.0, s.0) })
    }

    unsafe fn event_query(e: Event) -> Result<bool, GpuError> {
        let api = api()?;
        // SAFETY: the caller passes a live event.
        match unsafe { (api.hipEventQuery)(e.0) } {
            sys::hipSuccess => Ok(true),
            sys::hipErrorNotReady => Ok(false),
            r => check("hipEventQuery", r).map(|()| false),
        }
    }

    unsafe fn event_synchronize(e: Event) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller passes a live event.
        check("hipEventSynchronize", unsafe {
            (api.hipEventSynchronize)(e.0)
        })
    }

    unsafe fn stream_wait_event(s: Stream, e: Event) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller passes live handles.
        check("hipStreamWaitEvent", unsafe {
            (api.hipStreamWaitEvent)(s.0, e.0, 0)
        })
    }

    unsafe fn memcpy_async(dst: u64, src: u64, len: usize, s: Stream) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller passes ranges the runtime can reach; the pool is registered with
        // it, so its host addresses are valid endpoints under unified addressing
        // (hipMemcpyDefault).
        check("hipMemcpyAsync", unsafe {
            (api.hipMemcpyAsync)(
                void_ptr(dst),
                void_ptr(src),
                len,
                sys::hipMemcpyDefault,
                s.0,
            )
        })
    }

    fn copy_path(_batch: bool) -> &'static str {
        "hipMemcpyAsync per run"
    }

    unsafe fn memcpy_batch_async(
        _dsts: &mut [u64],
        _srcs: &mut [u64],
        _sizes: &mut [usize],
        _direction: Direction,
        _ordinal: i32,
        _s: Stream,
    ) -> Result<(), GpuError> {
        Err(GpuError::Invalid(
            "the HIP runtime kvd is built against has no batched copy".into(),
        ))
    }

    /// On AMD GPUs the runtime runs host↔device copies on the SDMA engines by default;
    /// `HSA_ENABLE_SDMA=0` moves them to shader blits, which take compute units from the model.
    fn warn_about_copy_settings(label: &str) {
        if std::env::var("HSA_ENABLE_SDMA").is_ok_and(|v| v == "0") {
            tracing::warn!(
                device = %label,
                "HSA_ENABLE_SDMA=0: copies run as shader blits on the GPU's compute units and \
                 slow the model; unset it for kvd"
            );
        }
    }

    fn ipc_open_mem(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64, GpuError> {
        let api = api()?;
        let h = sys::hipIpcMemHandle_t {
            reserved: handle.map(|b| b as c_char),
        };
        let mut base: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the caller made the device current.
        check("hipIpcOpenMemHandle", unsafe {
            (api.hipIpcOpenMemHandle)(&mut base, h, sys::hipIpcMemLazyEnablePeerAccess)
        })?;
        Ok(base as u64)
    }

    unsafe fn ipc_close_mem(base: u64) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller opened `base` and closes it once.
        check("hipIpcCloseMemHandle", unsafe {
            (api.hipIpcCloseMemHandle)(void_ptr(base))
        })
    }

    fn ipc_get_mem_handle(base: u64) -> Result<[u8; IPC_HANDLE_BYTES], GpuError> {
        let api = api()?;
        let mut h = sys::hipIpcMemHandle_t { reserved: [0; 64] };
        // SAFETY: out-pointer to a local; the runtime checks `base`.
        check("hipIpcGetMemHandle", unsafe {
            (api.hipIpcGetMemHandle)(&mut h, void_ptr(base))
        })?;
        Ok(h.reserved.map(|b| b as u8))
    }

    fn address_range(ptr: u64) -> Result<(u64, u64), GpuError> {
        let api = api()?;
        let (mut base, mut size): (sys::hipDeviceptr_t, usize) = (std::ptr::null_mut(), 0);
        // SAFETY: out-pointers to locals; the runtime checks `ptr`.
        check("hipMemGetAddressRange", unsafe {
            (api.hipMemGetAddressRange)(&mut base, &mut size, void_ptr(ptr))
        })?;
        Ok((base as u64, size as u64))
    }

    fn import_granularity(_ordinal: i32) -> Result<Option<u64>, GpuError> {
        Ok(None)
    }

    fn buffer_granularity(_ordinal: i32) -> Result<u64, GpuError> {
        Ok(TEST_GRANULARITY_BYTES)
    }

    fn address_reserve(size: u64, align: u64) -> Result<u64, GpuError> {
        let api = api()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; a device is current.
        check("hipMemAddressReserve", unsafe {
            (api.hipMemAddressReserve)(
                &mut ptr,
                size as usize,
                align as usize,
                std::ptr::null_mut(),
                0,
            )
        })?;
        Ok(ptr as u64)
    }

    unsafe fn address_free(ptr: u64, size: u64) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller reserved the range and unmapped everything in it.
        check("hipMemAddressFree", unsafe {
            (api.hipMemAddressFree)(void_ptr(ptr), size as usize)
        })
    }

    unsafe fn mem_map(ptr: u64, size: u64, h: Self::AllocHandle) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller maps inside a reservation, where nothing else is mapped.
        check("hipMemMap", unsafe {
            (api.hipMemMap)(void_ptr(ptr), size as usize, 0, h, 0)
        })
    }

    unsafe fn mem_unmap(ptr: u64, size: u64) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller mapped the range and unmaps it once.
        check("hipMemUnmap", unsafe {
            (api.hipMemUnmap)(void_ptr(ptr), size as usize)
        })
    }

    unsafe fn set_access(ptr: u64, size: u64, ordinal: i32) -> Result<(), GpuError> {
        let api = api()?;
        let desc = sys::hipMemAccessDesc {
            location: location(ordinal),
            flags: sys::hipMemAccessFlagsProtReadWrite,
        };
        // SAFETY: the caller mapped every granule of the range.
        check("hipMemSetAccess", unsafe {
            (api.hipMemSetAccess)(void_ptr(ptr), size as usize, &desc, 1)
        })
    }

    unsafe fn mem_release(h: Self::AllocHandle) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller got `h` from the runtime and releases it once.
        check("hipMemRelease", unsafe { (api.hipMemRelease)(h) })
    }

    fn mem_create(size: u64, ordinal: i32) -> Result<Self::AllocHandle, GpuError> {
        let api = api()?;
        let prop = sys::hipMemAllocationProp {
            type_: sys::hipMemAllocationTypePinned,
            requestedHandleType: sys::hipMemHandleTypePosixFileDescriptor,
            location: location(ordinal),
            win32HandleMetaData: std::ptr::null_mut(),
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
        };
        let mut h: sys::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; `prop` is a valid property struct.
        check("hipMemCreate", unsafe {
            (api.hipMemCreate)(&mut h, size as usize, &prop, 0)
        })?;
        Ok(h)
    }

    fn mem_import_fd(fd: BorrowedFd<'_>) -> Result<Self::AllocHandle, GpuError> {
        let api = api()?;
        let mut h: sys::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: POSIX_FILE_DESCRIPTOR import takes the descriptor's value in the pointer
        // argument (CUDA's convention, which HIP follows); the descriptor is open for the call.
        check("hipMemImportFromShareableHandle", unsafe {
            (api.hipMemImportFromShareableHandle)(
                &mut h,
                fd.as_raw_fd() as isize as *mut c_void,
                sys::hipMemHandleTypePosixFileDescriptor,
            )
        })?;
        Ok(h)
    }

    fn mem_retain_handle(ptr: u64) -> Result<Self::AllocHandle, GpuError> {
        let api = api()?;
        let mut h: sys::hipMemGenericAllocationHandle_t = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the runtime checks that `ptr` starts a VMM chunk.
        check("hipMemRetainAllocationHandle", unsafe {
            (api.hipMemRetainAllocationHandle)(&mut h, void_ptr(ptr))
        })?;
        Ok(h)
    }

    unsafe fn mem_export_fd(h: Self::AllocHandle) -> Result<OwnedFd, GpuError> {
        let api = api()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: out-pointer to a local int, as POSIX_FILE_DESCRIPTOR export requires.
        check("hipMemExportToShareableHandle", unsafe {
            (api.hipMemExportToShareableHandle)(
                (&mut fd as *mut std::ffi::c_int).cast(),
                h,
                sys::hipMemHandleTypePosixFileDescriptor,
                0,
            )
        })?;
        // SAFETY: the runtime returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn fd_export_supported() -> bool {
        driver::available().is_ok()
    }

    fn pointer_ordinal(ptr: u64) -> Result<i32, GpuError> {
        attribute(ptr, sys::HIP_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
    }

    /// ROCm documents the legacy-IPC pointer attribute as unsupported on AMD GPUs, so where the
    /// attribute is refused the answer comes from `hipMemRetainAllocationHandle`, which succeeds
    /// only for VMM (`hipMemCreate`) memory.
    fn legacy_ipc_capable(_ptr: u64, base: u64) -> Result<bool, GpuError> {
        if let Ok(legacy) = attribute(base, sys::HIP_POINTER_ATTRIBUTE_IS_LEGACY_HIP_IPC_CAPABLE) {
            return Ok(legacy != 0);
        }
        match Self::mem_retain_handle(base) {
            Ok(h) => {
                crate::runtime::release_vmm_handle::<Hip>(h);
                Ok(false)
            }
            Err(_) => Ok(true),
        }
    }

    fn mem_info() -> Result<(u64, u64), GpuError> {
        let api = api()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        check("hipMemGetInfo", unsafe {
            (api.hipMemGetInfo)(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    fn mem_alloc(size: u64) -> Result<u64, GpuError> {
        let api = api()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device is current.
        check("hipMalloc", unsafe {
            (api.hipMalloc)(&mut p, size as usize)
        })?;
        Ok(p as u64)
    }

    unsafe fn mem_free(ptr: u64) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller allocated `ptr` and frees it once.
        check("hipFree", unsafe { (api.hipFree)(void_ptr(ptr)) })
    }

    unsafe fn copy_to_device(dst: u64, src: &[u8]) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller passes mapped device memory; `src` is a live host slice.
        check("hipMemcpy", unsafe {
            (api.hipMemcpy)(
                void_ptr(dst),
                src.as_ptr().cast(),
                src.len(),
                sys::hipMemcpyDefault,
            )
        })
    }

    unsafe fn copy_from_device(dst: &mut [u8], src: u64) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller passes mapped device memory; `dst` is a live host slice.
        check("hipMemcpy", unsafe {
            (api.hipMemcpy)(
                dst.as_mut_ptr().cast(),
                src as usize as *const c_void,
                dst.len(),
                sys::hipMemcpyDefault,
            )
        })
    }

    unsafe fn memset_async(ptr: u64, value: u8, len: u64, s: Stream) -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: the caller passes mapped device memory and a live stream of this device.
        check("hipMemsetD8Async", unsafe {
            (api.hipMemsetD8Async)(void_ptr(ptr), value, len as usize, s.0)
        })
    }

    fn synchronize() -> Result<(), GpuError> {
        let api = api()?;
        // SAFETY: no arguments; the device is current.
        check("hipDeviceSynchronize", unsafe {
            (api.hipDeviceSynchronize)()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amd_uuids_print_as_their_unique_id_and_nvidia_ones_like_nvidia_smi() {
        // ROCm's hipDeviceGetUuid: sixteen ASCII characters, as rocm-smi --showuniqueid.
        assert_eq!(
            Hip::format_uuid(b"7b32ac5a1c2d6b1f"),
            "GPU-7b32ac5a1c2d6b1f"
        );
        // HIP's NVIDIA platform: NVIDIA's binary UUID.
        let u = [
            0x3f, 0x2a, 0x1b, 0x0c, 0xde, 0xad, 0xbe, 0xef, 0, 1, 2, 3, 4, 5, 6, 7,
        ];
        assert_eq!(
            Hip::format_uuid(&u),
            "GPU-3f2a1b0c-dead-beef-0001-020304050607"
        );
    }
}
