//! GPU VMM memory — PyTorch's `expandable_segments:True`, vLLM's cumem allocator — which legacy
//! IPC cannot share (`cudaIpcGetMemHandle` fails with `cudaErrorInvalidValue`). It can be
//! shared by file descriptor instead: the client walks the physical chunks that back its KV
//! range and exports each (`cuMemExportToShareableHandle(POSIX_FD)` or HIP's); kvd imports each
//! descriptor, reserves one virtual range, maps the chunks at the same relative offsets and sets
//! access. Only kvd's fd socket is shared between the processes: no `pidfd_getfd`, no shared PID
//! namespace, so kvd and vLLM may run in separate containers.
//!
//! [`Mapping`] is the reserved range both sides use; [`VmmImport`] is kvd's import. The client's
//! side (walking and exporting chunks, test buffers) is in [`super::client`] and
//! [`super::buffers`].

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use crate::error::{check_range, release_failed, GpuError};
use crate::runtime::api::Runtime;
use crate::runtime::ctx::{release_handle, DeviceCtx};

/// A reserved virtual range with physical chunks mapped into it; unmapped and freed on drop.
#[derive(Debug)]
pub(crate) struct Mapping<R: Runtime> {
    pub(crate) ptr: u64,
    pub(crate) size: u64,
    mapped: Vec<(u64, u64)>,
    _runtime: std::marker::PhantomData<R>,
}

impl<R: Runtime> Mapping<R> {
    /// Reserves `size` bytes aligned to `align` (0: the runtime's default); a device is current.
    pub(crate) fn reserve(size: u64, align: u64) -> Result<Self, GpuError> {
        Ok(Mapping {
            ptr: R::address_reserve(size, align)?,
            size,
            mapped: Vec::new(),
            _runtime: std::marker::PhantomData,
        })
    }

    /// Maps a physical allocation of `size` bytes at `offset`. The caller may release the handle
    /// afterwards: the mapping keeps the memory alive.
    pub(crate) fn map(
        &mut self,
        offset: u64,
        size: u64,
        handle: R::AllocHandle,
    ) -> Result<(), GpuError> {
        check_range("the reserved VMM range", offset, size, self.size)?;
        // SAFETY: the target lies inside the reserved range and no other chunk was mapped there
        // (offsets are checked disjoint by the caller).
        unsafe { R::mem_map(self.ptr + offset, size, handle) }?;
        self.mapped.push((offset, size));
        Ok(())
    }

    /// Maps `handle` at `offset` and releases the handle, whether or not the map succeeded.
    pub(crate) fn map_and_release(
        &mut self,
        offset: u64,
        size: u64,
        handle: R::AllocHandle,
    ) -> Result<(), GpuError> {
        let mapped = self.map(offset, size, handle);
        release_handle::<R>(handle);
        mapped
    }

    /// Gives device `ordinal` read-write access to the whole range.
    pub(crate) fn set_access(&self, ordinal: i32) -> Result<(), GpuError> {
        // SAFETY: callers map every granule of the range before asking for access.
        unsafe { R::set_access(self.ptr, self.size, ordinal) }
    }
}

impl<R: Runtime> Drop for Mapping<R> {
    fn drop(&mut self) {
        for &(off, size) in &self.mapped {
            // SAFETY: mapped by `map`, unmapped once.
            if let Err(e) = unsafe { R::mem_unmap(self.ptr + off, size) } {
                release_failed("a VMM chunk mapping", e);
            }
        }
        // SAFETY: reserved by `reserve`, freed once after every mapping in it is gone.
        if let Err(e) = unsafe { R::address_free(self.ptr, self.size) } {
            release_failed("a VMM address range", e);
        }
    }
}

/// kvd side: chunks imported from descriptors and mapped into one range.
#[derive(Debug)]
pub struct VmmImport<R: Runtime> {
    device: Arc<DeviceCtx<R>>,
    map: Option<Mapping<R>>,
    range_offset: u64,
    size_bytes: u64,
}

impl<R: Runtime> VmmImport<R> {
    /// Imports `chunks` (descriptor, offset from the first chunk, size) and maps them; the KV
    /// range starts `range_offset` bytes in and is `size_bytes` long.
    pub(crate) fn import(
        device: Arc<DeviceCtx<R>>,
        chunks: Vec<(OwnedFd, u64, u64)>,
        range_offset: u64,
        size_bytes: u64,
    ) -> Result<Self, GpuError> {
        device.make_current()?;
        if chunks.is_empty() {
            return Err(GpuError::Invalid("VMM registration without chunks".into()));
        }
        let mut spans: Vec<(u64, u64)> = chunks.iter().map(|c| (c.1, c.2)).collect();
        spans.sort_unstable();
        if spans[0].0 != 0 || spans.windows(2).any(|w| w[0].0 + w[0].1 != w[1].0) {
            return Err(GpuError::Invalid(
                "VMM chunks must tile the range from offset 0 without gaps or overlaps".into(),
            ));
        }
        let total = spans.last().map(|s| s.0 + s.1).unwrap_or(0);
        check_range("the VMM chunks", range_offset, size_bytes, total)?;
        // Where the runtime has no granularity query kvd can make without the allocation's
        // properties (HIP), the reservation takes the default alignment and the chunks are taken
        // as the exporter's runtime made them, multiples of its granularity.
        let granularity = R::import_granularity(device.ordinal)?;
        if let Some(g) = granularity {
            if spans.iter().any(|s| s.0 % g != 0 || s.1 % g != 0) {
                return Err(GpuError::Invalid(format!(
                    "VMM chunks must be multiples of the {g}-byte granularity"
                )));
            }
        }
        let mut map = Mapping::<R>::reserve(total, granularity.unwrap_or(0))?;
        for (fd, offset, size) in chunks {
            let h = R::mem_import_fd(fd.as_fd())?;
            drop(fd);
            map.map_and_release(offset, size, h)?;
        }
        map.set_access(device.ordinal)?;
        Ok(VmmImport {
            device,
            map: Some(map),
            range_offset,
            size_bytes,
        })
    }

    /// Device address of `offset` within the KV range, checked for `len` bytes.
    pub(crate) fn device_ptr(&self, offset: u64, len: u64) -> Result<u64, GpuError> {
        check_range("imported VMM memory", offset, len, self.size_bytes)?;
        let map = self
            .map
            .as_ref()
            .ok_or_else(|| GpuError::Invalid("unmapped".into()))?;
        Ok(map.ptr + self.range_offset + offset)
    }

    pub(crate) fn device(&self) -> &Arc<DeviceCtx<R>> {
        &self.device
    }
}

impl<R: Runtime> Drop for VmmImport<R> {
    fn drop(&mut self) {
        if let Err(e) = self.device.make_current() {
            release_failed("an imported VMM range", e);
            std::mem::forget(self.map.take());
            return;
        }
        self.map.take();
        tracing::debug!(device = %self.device.label, "released an imported VMM range");
    }
}
