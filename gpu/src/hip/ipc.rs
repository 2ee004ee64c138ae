//! Client allocations imported through legacy HIP IPC (`hipIpcOpenMemHandle`): opened once per
//! allocation (by its base's handle) and closed when the last registration using it is gone.

use std::sync::Arc;

use super::device::DeviceInner;
use super::driver::{api, check, release_failed, DevicePtr};
use super::sys;
use crate::device::IPC_HANDLE_BYTES;
use crate::error::{check_range, GpuError};

/// One opened allocation.
#[derive(Debug)]
pub(crate) struct IpcMemory {
    device: Arc<DeviceInner>,
    base: DevicePtr,
    size_bytes: u64,
}

impl IpcMemory {
    /// Opens the allocation whose base exported `handle`.
    pub(crate) fn open(
        device: Arc<DeviceInner>,
        handle: [u8; IPC_HANDLE_BYTES],
    ) -> Result<Self, GpuError> {
        device.make_current()?;
        let api = api()?;
        let h = sys::hipIpcMemHandle_t {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut base: *mut std::ffi::c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; the device is current on this thread.
        let r =
            unsafe { (api.hipIpcOpenMemHandle)(&mut base, h, sys::hipIpcMemLazyEnablePeerAccess) };
        check("hipIpcOpenMemHandle", r)?;
        let mut range_base: sys::hipDeviceptr_t = std::ptr::null_mut();
        let mut size: usize = 0;
        // SAFETY: out-pointers to locals; `base` is a mapping this process now owns.
        let r = unsafe { (api.hipMemGetAddressRange)(&mut range_base, &mut size, base) };
        // Owned from here on, so that an error below closes the mapping.
        let mem = IpcMemory {
            device,
            base: base as DevicePtr,
            size_bytes: size as u64,
        };
        check("hipMemGetAddressRange", r)?;
        Ok(mem)
    }

    /// A view of `[offset, offset + size)` of the allocation: the KV range a client registers.
    pub(crate) fn with_range(
        self: &Arc<Self>,
        offset_bytes: u64,
        size_bytes: u64,
    ) -> Result<IpcRange, GpuError> {
        check_range(
            "the exported allocation",
            offset_bytes,
            size_bytes,
            self.size_bytes,
        )?;
        Ok(IpcRange {
            memory: self.clone(),
            offset_bytes,
            size_bytes,
        })
    }
}

impl Drop for IpcMemory {
    fn drop(&mut self) {
        let r = self.device.make_current().and_then(|()| {
            let api = api()?;
            // SAFETY: `base` came from hipIpcOpenMemHandle and is closed exactly once, after
            // every copy that used it completed (copy jobs hold a reference until then).
            check("hipIpcCloseMemHandle", unsafe {
                (api.hipIpcCloseMemHandle)(self.base as usize as *mut std::ffi::c_void)
            })
        });
        match r {
            Ok(()) => tracing::debug!(device = %self.device.label, "closed an IPC mapping"),
            Err(e) => release_failed("an IPC mapping", e),
        }
    }
}

/// The registered KV range of an opened allocation.
#[derive(Debug)]
pub struct IpcRange {
    memory: Arc<IpcMemory>,
    offset_bytes: u64,
    size_bytes: u64,
}

impl IpcRange {
    /// Device address of `offset` within the range, checked for `len` bytes.
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<DevicePtr, GpuError> {
        check_range("imported GPU memory", offset, len, self.size_bytes)?;
        Ok(self.memory.base + self.offset_bytes + offset)
    }

    pub(crate) fn device(&self) -> &Arc<DeviceInner> {
        &self.memory.device
    }
}
