//! [`Cuda`]: the [`Runtime`] trait on the CUDA driver API, each method one raw call through
//! cudarc's `sys` bindings checked by [`check`]. The calls that need more than one step
//! (contexts, IPC events, device identity) are in [`super::driver`].

use std::ffi::{c_void, CStr};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use cudarc::driver::sys;

use super::driver::{self, check, has_symbol, Event, PrimaryContext, Stream};
use crate::copy::Direction;
use crate::error::GpuError;
use crate::runtime::Runtime;
use crate::types::IPC_HANDLE_BYTES;

/// NVIDIA's CUDA driver (`libcuda.so.1`), loaded at run time.
#[derive(Debug)]
pub struct Cuda;

fn location(device: Option<i32>) -> sys::CUmemLocation {
    match device {
        Some(ordinal) => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: ordinal,
        },
        None => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
    }
}

fn pinned_prop(ordinal: i32) -> sys::CUmemAllocationProp {
    sys::CUmemAllocationProp {
        type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        requestedHandleTypes:
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        location: location(Some(ordinal)),
        win32HandleMetaData: std::ptr::null_mut(),
        allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
            compressionType: 0,
            gpuDirectRDMACapable: 0,
            usage: 0,
            reserved: [0; 4],
        },
    }
}

/// Allocation granularity of device `ordinal` for exportable pinned memory.
fn granularity(ordinal: i32) -> Result<u64, GpuError> {
    let prop = pinned_prop(ordinal);
    let mut g: usize = 0;
    // SAFETY: out-pointer to a local; `prop` is a valid property struct.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut g,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    })?;
    Ok(g as u64)
}

fn attribute(ptr: u64, attr: sys::CUpointer_attribute) -> Result<i32, GpuError> {
    let mut v: i32 = 0;
    // SAFETY: both attributes asked for here are 32-bit integers; out-pointer to a local.
    let r = unsafe { sys::cuPointerGetAttribute((&mut v as *mut i32).cast(), attr, ptr) };
    check("cuPointerGetAttribute", r)?;
    Ok(v)
}

/// The PCI bus id of device `ordinal` (`0000:1B:00.0`).
fn bus_id(ordinal: i32) -> Result<String, GpuError> {
    let mut dev: sys::CUdevice = 0;
    // SAFETY: out-pointer to a local.
    check("cuDeviceGet", unsafe {
        sys::cuDeviceGet(&mut dev, ordinal)
    })?;
    let mut id = [0 as std::ffi::c_char; 64];
    // SAFETY: the buffer holds 64 bytes, as passed (the driver needs 13).
    check("cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(id.as_mut_ptr(), 64, dev)
    })?;
    // SAFETY: cuDeviceGetPCIBusId NUL-terminates within the buffer.
    Ok(unsafe { CStr::from_ptr(id.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

const FD_HANDLE: sys::CUmemAllocationHandleType =
    sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;

impl Runtime for Cuda {
    const NAME: &'static str = "CUDA";
    const LABEL: &'static str = "cuda";
    const DRIVER: &'static str = "the CUDA driver";
    const VISIBILITY_FIX: &'static str =
        "unset CUDA_VISIBLE_DEVICES for kvd, or give its container all GPUs";
    const COPY_CALL: &'static str = "cuMemcpyAsync";
    const EXPORT_FIX: &'static str = "; this VMM memory was allocated without an exportable \
        handle type (vLLM's cumem allocator does this): run vLLM with PyTorch's \
        expandable_segments:True instead, or without the cumem allocator";

    type Context = PrimaryContext;
    type Stream = Stream;
    type Event = Event;
    type AllocHandle = sys::CUmemGenericAllocationHandle;

    fn available() -> Result<(), GpuError> {
        driver::available()
    }

    fn device_count() -> Result<i32, GpuError> {
        driver::available()?;
        let mut n = 0;
        // SAFETY: out-pointer to a local.
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut n) })?;
        Ok(n)
    }

    fn device_identity(ordinal: i32) -> Result<([u8; 16], String), GpuError> {
        let mut dev: sys::CUdevice = 0;
        // SAFETY: out-pointer to a local.
        check("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut dev, ordinal)
        })?;
        let mut uuid = sys::CUuuid { bytes: [0; 16] };
        // SAFETY: out-pointer to a local CUuuid.
        check("cuDeviceGetUuid_v2", unsafe {
            sys::cuDeviceGetUuid_v2(&mut uuid, dev)
        })?;
        let mut name = [0 as std::ffi::c_char; 128];
        // SAFETY: the buffer holds 128 bytes, as passed.
        check("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), 128, dev)
        })?;
        // SAFETY: cuDeviceGetName NUL-terminates within the buffer.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        Ok((uuid.bytes.map(|b| b as u8), name))
    }

    fn pci_bus_id(ordinal: i32) -> Option<Result<String, GpuError>> {
        Some(bus_id(ordinal))
    }

    fn retain(ordinal: i32) -> Result<PrimaryContext, GpuError> {
        PrimaryContext::retain(ordinal)
    }

    fn retain_for_copies(ordinal: i32) -> Result<PrimaryContext, GpuError> {
        PrimaryContext::retain_for_copies(ordinal)
    }

    fn make_current(ctx: &PrimaryContext) -> Result<(), GpuError> {
        ctx.make_current()
    }

    unsafe fn host_register(ptr: *mut c_void, len: usize) -> Result<(), GpuError> {
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: the caller passes a live mapping registered with no other range.
        check("cuMemHostRegister_v2", unsafe {
            sys::cuMemHostRegister_v2(ptr, len, flags)
        })
    }

    unsafe fn host_unregister(ptr: *mut c_void) -> Result<(), GpuError> {
        // SAFETY: the caller registered `ptr` and unregisters it once.
        check("cuMemHostUnregister", unsafe {
            sys::cuMemHostUnregister(ptr)
        })
    }

    fn stream_create() -> Result<Stream, GpuError> {
        let mut st: sys::CUstream = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the caller made the context current.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut st, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
        })?;
        Ok(Stream(st))
    }

    unsafe fn stream_destroy(s: Stream) -> Result<(), GpuError> {
        // SAFETY: the caller created `s` and destroys it once.
        check("cuStreamDestroy_v2", unsafe {
            sys::cuStreamDestroy_v2(s.0)
        })
    }

    fn stream_from_raw(raw: u64) -> Stream {
        Stream(raw as sys::CUstream)
    }

    fn ipc_event_create() -> Result<(Event, [u8; IPC_HANDLE_BYTES]), GpuError> {
        driver::create_ipc_event()
    }

    fn ipc_event_open(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<Event, GpuError> {
        driver::open_ipc_event(handle)
    }

    fn done_event_create() -> Result<Event, GpuError> {
        let flags = sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the caller made the context current.
        check("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut e, flags)
        })?;
        Ok(Event(e))
    }

    unsafe fn event_destroy(e: Event) -> Result<(), GpuError> {
        // SAFETY: the caller owns `e` and never uses it again.
        check("cuEventDestroy_v2", unsafe { sys::cuEventDestroy_v2(e.0) })
    }

    unsafe fn event_record(e: Event, s: Stream) -> Result<(), GpuError> {
        // SAFETY: the caller passes live handles of the current context.
        check("cuEventRecord", unsafe { sys::cuEventRecord(e.0, s.0) })
    }

    unsafe fn event_query(e: Event) -> Result<bool, GpuError> {
        // SAFETY: the caller passes a live event.
        match unsafe { sys::cuEventQuery(e.0) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => check("cuEventQuery", r).map(|()| false),
        }
    }

    unsafe fn event_synchronize(e: Event) -> Result<(), GpuError> {
        // SAFETY: the caller passes a live event.
        check("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(e.0)
        })
    }

    unsafe fn stream_wait_event(s: Stream, e: Event) -> Result<(), GpuError> {
        // SAFETY: the caller passes live handles.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(s.0, e.0, 0)
        })
    }

    unsafe fn memcpy_async(dst: u64, src: u64, len: usize, s: Stream) -> Result<(), GpuError> {
        // SAFETY: the caller passes ranges the driver can reach; unified addressing makes the
        // pinned pool's host addresses valid CUdeviceptrs.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(dst, src, len, s.0)
        })
    }

    fn copy_path(batch: bool) -> &'static str {
        if batch {
            "cuMemcpyBatchAsync"
        } else {
            "cuMemcpyAsync per run (no batch copy in this driver)"
        }
    }

    fn batch_copy_available() -> bool {
        has_symbol("cuMemcpyBatchAsync_v2") && std::env::var_os("KVD_NO_BATCH_COPY").is_none()
    }

    unsafe fn memcpy_batch_async(
        dsts: &mut [u64],
        srcs: &mut [u64],
        sizes: &mut [usize],
        direction: Direction,
        ordinal: i32,
        s: Stream,
    ) -> Result<(), GpuError> {
        let (src_dev, dst_dev) = match direction {
            Direction::D2h => (Some(ordinal), None),
            Direction::H2d => (None, Some(ordinal)),
        };
        let mut attr = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: location(src_dev),
            dstLocHint: location(dst_dev),
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        };
        let mut idx = 0usize;
        // SAFETY: the three slices have the same length (the caller's promise) and every address
        // is reachable; one attribute applies to all descriptors.
        check("cuMemcpyBatchAsync_v2", unsafe {
            sys::cuMemcpyBatchAsync_v2(
                dsts.as_mut_ptr(),
                srcs.as_mut_ptr(),
                sizes.as_mut_ptr(),
                sizes.len(),
                &mut attr,
                &mut idx,
                1,
                s.0,
            )
        })
    }

    fn ipc_open_mem(handle: &[u8; IPC_HANDLE_BYTES]) -> Result<u64, GpuError> {
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the caller made the context current.
        check("cuIpcOpenMemHandle_v2", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })?;
        Ok(base)
    }

    unsafe fn ipc_close_mem(base: u64) -> Result<(), GpuError> {
        // SAFETY: the caller opened `base` and closes it once.
        check("cuIpcCloseMemHandle", unsafe {
            sys::cuIpcCloseMemHandle(base)
        })
    }

    fn ipc_get_mem_handle(base: u64) -> Result<[u8; IPC_HANDLE_BYTES], GpuError> {
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: out-pointer to a local; the driver checks `base`.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, base)
        })?;
        Ok(h.reserved.map(|b| b as u8))
    }

    fn address_range(ptr: u64) -> Result<(u64, u64), GpuError> {
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: out-pointers to locals; the driver checks `ptr`.
        check("cuMemGetAddressRange_v2", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr)
        })?;
        Ok((base, size as u64))
    }

    fn import_granularity(ordinal: i32) -> Result<Option<u64>, GpuError> {
        granularity(ordinal).map(Some)
    }

    fn buffer_granularity(ordinal: i32) -> Result<u64, GpuError> {
        granularity(ordinal)
    }

    fn address_reserve(size: u64, align: u64) -> Result<u64, GpuError> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; a context is current.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut ptr, size as usize, align as usize, 0, 0)
        })?;
        Ok(ptr)
    }

    unsafe fn address_free(ptr: u64, size: u64) -> Result<(), GpuError> {
        // SAFETY: the caller reserved the range and unmapped everything in it.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr, size as usize)
        })
    }

    unsafe fn mem_map(ptr: u64, size: u64, h: Self::AllocHandle) -> Result<(), GpuError> {
        // SAFETY: the caller maps inside a reservation, where nothing else is mapped.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size as usize, 0, h, 0)
        })
    }

    unsafe fn mem_unmap(ptr: u64, size: u64) -> Result<(), GpuError> {
        // SAFETY: the caller mapped the range and unmaps it once.
        check("cuMemUnmap", unsafe { sys::cuMemUnmap(ptr, size as usize) })
    }

    unsafe fn set_access(ptr: u64, size: u64, ordinal: i32) -> Result<(), GpuError> {
        let desc = sys::CUmemAccessDesc {
            location: location(Some(ordinal)),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: the caller mapped every granule of the range.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr, size as usize, &desc, 1)
        })
    }

    unsafe fn mem_release(h: Self::AllocHandle) -> Result<(), GpuError> {
        // SAFETY: the caller got `h` from the driver and releases it once.
        check("cuMemRelease", unsafe { sys::cuMemRelease(h) })
    }

    fn mem_create(size: u64, ordinal: i32) -> Result<Self::AllocHandle, GpuError> {
        let prop = pinned_prop(ordinal);
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer to a local; `prop` is a valid property struct.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut h, size as usize, &prop, 0)
        })?;
        Ok(h)
    }

    fn mem_import_fd(fd: BorrowedFd<'_>) -> Result<Self::AllocHandle, GpuError> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: POSIX_FILE_DESCRIPTOR import takes the descriptor's value as the "pointer";
        // the descriptor is open for the call.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut h,
                fd.as_raw_fd() as usize as *mut c_void,
                FD_HANDLE,
            )
        })?;
        Ok(h)
    }

    fn mem_retain_handle(ptr: u64) -> Result<Self::AllocHandle, GpuError> {
        let mut h: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: out-pointer to a local; the driver checks that `ptr` starts a VMM chunk.
        check("cuMemRetainAllocationHandle", unsafe {
            sys::cuMemRetainAllocationHandle(&mut h, ptr as *mut c_void)
        })?;
        Ok(h)
    }

    unsafe fn mem_export_fd(h: Self::AllocHandle) -> Result<OwnedFd, GpuError> {
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: out-pointer to a local int, as POSIX_FILE_DESCRIPTOR export requires.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                h,
                FD_HANDLE,
                0,
            )
        })?;
        // SAFETY: the driver returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn fd_export_supported() -> bool {
        driver::available().is_ok() && has_symbol("cuMemExportToShareableHandle")
    }

    fn pointer_ordinal(ptr: u64) -> Result<i32, GpuError> {
        attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        )
    }

    fn legacy_ipc_capable(ptr: u64, _base: u64) -> Result<bool, GpuError> {
        let legacy = attribute(
            ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        )?;
        Ok(legacy != 0)
    }

    fn mem_info() -> Result<(u64, u64), GpuError> {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals; a context is current.
        check("cuMemGetInfo_v2", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok((free as u64, total as u64))
    }

    fn mem_alloc(size: u64) -> Result<u64, GpuError> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; a context is current.
        check("cuMemAlloc_v2", unsafe {
            sys::cuMemAlloc_v2(&mut ptr, size as usize)
        })?;
        Ok(ptr)
    }

    unsafe fn mem_free(ptr: u64) -> Result<(), GpuError> {
        // SAFETY: the caller allocated `ptr` and frees it once.
        check("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr) })
    }

    unsafe fn copy_to_device(dst: u64, src: &[u8]) -> Result<(), GpuError> {
        // SAFETY: the caller passes mapped device memory; `src` is a live host slice.
        check("cuMemcpyHtoD_v2", unsafe {
            sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len())
        })
    }

    unsafe fn copy_from_device(dst: &mut [u8], src: u64) -> Result<(), GpuError> {
        // SAFETY: the caller passes mapped device memory; `dst` is a live host slice.
        check("cuMemcpyDtoH_v2", unsafe {
            sys::cuMemcpyDtoH_v2(dst.as_mut_ptr().cast(), src, dst.len())
        })
    }

    unsafe fn memset_async(ptr: u64, value: u8, len: u64, s: Stream) -> Result<(), GpuError> {
        // SAFETY: the caller passes mapped device memory and a live stream.
        check("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(ptr, value, len as usize, s.0)
        })
    }

    fn synchronize() -> Result<(), GpuError> {
        // SAFETY: no arguments; a context is current.
        check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }
}
