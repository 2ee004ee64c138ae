//! Client allocations imported through legacy CUDA IPC: opened once per allocation (by its
//! base's handle) and closed when the last registration that uses it is gone.

use std::sync::Arc;

use cudarc::driver::sys;

use super::device::DeviceInner;
use super::driver::{check, release_failed};
use crate::device::IPC_HANDLE_BYTES;
use crate::error::{check_range, GpuError};

/// One opened allocation.
#[derive(Debug)]
pub(crate) struct IpcMemory {
    device: Arc<DeviceInner>,
    base: sys::CUdeviceptr,
    size_bytes: u64,
}

impl IpcMemory {
    /// Opens the allocation whose base exported `handle`.
    pub(crate) fn open(
        device: Arc<DeviceInner>,
        handle: [u8; IPC_HANDLE_BYTES],
    ) -> Result<Self, GpuError> {
        device.ctx.make_current()?;
        let h = sys::CUipcMemHandle {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut base: sys::CUdeviceptr = 0;
        // SAFETY: out-pointer to a local; the device's context is current on this thread.
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        };
        check("cuIpcOpenMemHandle_v2", r)?;
        let mut range_base: sys::CUdeviceptr = 0;
        let mut size: usize = 0;
        // SAFETY: out-pointers to locals; `base` is a mapping this process now owns.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut range_base, &mut size, base) };
        let mem = IpcMemory {
            device,
            base,
            size_bytes: size as u64,
        };
        check("cuMemGetAddressRange_v2", r)?;
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
        if let Err(e) = self.device.ctx.make_current() {
            release_failed("an IPC mapping", e);
            return;
        }
        // SAFETY: `base` came from cuIpcOpenMemHandle_v2 and is closed exactly once, after every
        // copy that used it completed (copy jobs hold a reference until then).
        let r = unsafe { sys::cuIpcCloseMemHandle(self.base) };
        match check("cuIpcCloseMemHandle", r) {
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
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<sys::CUdeviceptr, GpuError> {
        check_range("imported GPU memory", offset, len, self.size_bytes)?;
        Ok(self.memory.base + self.offset_bytes + offset)
    }

    pub(crate) fn device(&self) -> &Arc<DeviceInner> {
        &self.memory.device
    }
}
