//! Client allocations imported through legacy IPC (`cuIpcOpenMemHandle`/`hipIpcOpenMemHandle`):
//! opened once per allocation (by its base's handle) and closed when the last registration that
//! uses it is gone. The per-allocation dedup lives with the device ([`super::device`]).

use std::sync::Arc;

use crate::error::{check_range, release_failed, GpuError};
use crate::runtime::api::Runtime;
use crate::runtime::ctx::DeviceCtx;
use crate::types::IPC_HANDLE_BYTES;

/// One opened allocation.
#[derive(Debug)]
pub(crate) struct IpcMemory<R: Runtime> {
    device: Arc<DeviceCtx<R>>,
    base: u64,
    size_bytes: u64,
}

impl<R: Runtime> IpcMemory<R> {
    /// Opens the allocation whose base exported `handle`.
    pub(crate) fn open(
        device: Arc<DeviceCtx<R>>,
        handle: [u8; IPC_HANDLE_BYTES],
    ) -> Result<Self, GpuError> {
        device.make_current()?;
        let base = R::ipc_open_mem(&handle)?;
        let range = R::address_range(base);
        // Owned from here on, so that an error below closes the mapping.
        let mut mem = IpcMemory {
            device,
            base,
            size_bytes: 0,
        };
        mem.size_bytes = range?.1;
        Ok(mem)
    }

    /// A view of `[offset, offset + size)` of the allocation: the KV range a client registers.
    pub(crate) fn with_range(
        self: &Arc<Self>,
        offset_bytes: u64,
        size_bytes: u64,
    ) -> Result<IpcRange<R>, GpuError> {
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

impl<R: Runtime> Drop for IpcMemory<R> {
    fn drop(&mut self) {
        let r = self.device.make_current().and_then(|()| {
            // SAFETY: `base` came from ipc_open_mem and is closed exactly once, after every copy
            // that used it completed (copy jobs hold a reference until then).
            unsafe { R::ipc_close_mem(self.base) }
        });
        match r {
            Ok(()) => tracing::debug!(device = %self.device.label, "closed an IPC mapping"),
            Err(e) => release_failed("an IPC mapping", e),
        }
    }
}

/// The registered KV range of an opened allocation.
#[derive(Debug)]
pub struct IpcRange<R: Runtime> {
    memory: Arc<IpcMemory<R>>,
    offset_bytes: u64,
    size_bytes: u64,
}

impl<R: Runtime> IpcRange<R> {
    /// Device address of `offset` within the range, checked for `len` bytes.
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<u64, GpuError> {
        check_range("imported GPU memory", offset, len, self.size_bytes)?;
        Ok(self.memory.base + self.offset_bytes + offset)
    }

    pub(crate) fn device(&self) -> &Arc<DeviceCtx<R>> {
        &self.memory.device
    }
}
